"""Tokenizers: training (BPE, unigram, from files or a datasets source), loading, special ids,
the Hugging Face GPT-2 path, and misuse."""

import json
import os

import pytest
from data_helpers import corpus_docs, corpus_files, small_corpus
from families import CAUSAL_LM

from tpzoo.data.tokenizer import SPECIAL_PIECES, load_tokenizer, train_tokenizer

pytestmark = pytest.mark.tier("unit")



TEXT = "The clever fox hides near the river. Do two owls sleep? Yes, they do."


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_train_and_load(tmp_path, model_type):
    path = train_tokenizer(corpus_files(), str(tmp_path / "tok"), 200, model_type=model_type)
    tok = load_tokenizer(path)
    assert tok.vocab_size == 200
    assert (tok.pad, tok.unk, tok.eod, tok.cls, tok.sep, tok.mask) == (0, 1, 2, 3, 4, 5)
    assert tok.pieces()[:6] == list(SPECIAL_PIECES.values())
    ids = tok.encode(TEXT)
    assert ids and all(6 <= i < 200 for i in ids) and tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eod]) == TEXT  # special tokens decode to nothing
    starts = [tok.word_start[i] for i in tok.encode("owls")]
    assert starts[0] and not any(starts[1:])
    ref = tok.reference()
    assert ref["kind"] == "sentencepiece" and ref["vocab_size"] == 200 and len(ref["sha256"]) == 64
    assert load_tokenizer(**ref).encode(TEXT) == ids
    assert load_tokenizer(tmp_path).path == path  # a folder holding one .model file


def test_train_from_datasets_source(tmp_path):
    import datasets  # here, not at the top: `pytest -m gpu` collects this file on machines without datasets

    source = datasets.Dataset.from_dict({"body": corpus_docs()})
    tok = load_tokenizer(train_tokenizer(source, str(tmp_path / "tok"), 250, key="body"))
    assert tok.vocab_size == 250 and tok.decode(tok.encode(TEXT)) == TEXT
    with pytest.raises(ValueError, match="'text' is not a column.*body"):
        train_tokenizer(source, str(tmp_path / "tok2"), 250)


def test_misuse(tmp_path):
    files = corpus_files()
    with pytest.raises(ValueError, match="vocab_size=6 leaves no room beside the 6 special tokens"):
        train_tokenizer(files, str(tmp_path / "t"), 6)
    with pytest.raises(ValueError, match="Vocabulary size is smaller than required_chars"):
        train_tokenizer(files, str(tmp_path / "t"), 20)
    with pytest.raises(ValueError, match="model_type must be 'bpe' or 'unigram'"):
        train_tokenizer(files, str(tmp_path / "t"), 200, model_type="wordpiece")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": "   "}\n')
    with pytest.raises(ValueError, match="is empty"):
        train_tokenizer(str(empty), str(tmp_path / "t"), 200)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        train_tokenizer(str(tmp_path / "missing.jsonl"), str(tmp_path / "t"), 200)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.model")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a sentencepiece model"):
        load_tokenizer(tmp_path / "bad.model")
    with pytest.raises(ValueError, match="not the recorded"):
        load_tokenizer(small_corpus()["tokenizer"], sha256="0" * 64)


def make_gpt2_tokenizer(folder):
    """A tiny GPT-2 style byte-level BPE, saved as a converted checkpoint would hold it."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus_docs(), vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False)
    os.makedirs(folder, exist_ok=True)
    bpe.save_model(str(folder))  # vocab.json + merges.txt
    (folder / "config.json").write_text(json.dumps({"model_type": CAUSAL_LM.hf_model_type}))
    return folder


def test_hugging_face_gpt2_tokenizer(tmp_path):
    from transformers import GPT2TokenizerFast

    folder = make_gpt2_tokenizer(tmp_path / "ckpt")
    tok = load_tokenizer(folder)
    reference = GPT2TokenizerFast(str(folder / "vocab.json"), str(folder / "merges.txt"))
    assert tok.kind == "huggingface" and tok.vocab_size == len(reference)
    assert tok.eod == reference.eos_token_id == reference.convert_tokens_to_ids("<|endoftext|>")
    assert (tok.cls, tok.sep, tok.mask, tok.pad) == (None, None, None, None)
    ids = tok.encode(TEXT)
    assert ids == reference.encode(TEXT) and tok.decode(ids) == TEXT
    assert tok.word_start[tok.encode(" owls")[0]]
    reference.save_pretrained(str(tmp_path / "fast"))  # tokenizer.json, as newer checkpoints hold
    fast = load_tokenizer(tmp_path / "fast")
    assert fast.files[0].endswith("tokenizer.json") and fast.encode(TEXT) == ids and fast.eod == tok.eod
