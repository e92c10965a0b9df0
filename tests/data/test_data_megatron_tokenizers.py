"""Megatron-LM's tokenizers (--tokenizer-type and its files): GPT-2 BPE and BERT WordPiece files made
by the ``tokenizers`` library match transformers' fast tokenizers on the same files, NullTokenizer's
meaning, references reload every kind, the flags' rules and their one-line errors."""

import argparse
import pickle

import numpy as np
import pytest
from families import HUB_NAME
from megatron_vocab import BERT_VOCAB, GPT2_VOCAB, megatron_files
from real_text import documents

from tpzoo.data.build import check_data_tokenizer
from tpzoo.data.indexed import IndexedDataset, IndexedDatasetBuilder
from tpzoo.data.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer, recorded_tokenizer
from tpzoo.data.tokenizer_types import (BertWordPieceCase, BertWordPieceLowerCase, GPT2BPETokenizer, NullTokenizer,
                                        TokenizerFlags, add_tokenizer_args, tokenizer_of)

pytestmark = pytest.mark.tier("unit")



ODD = " ünïcode ✓ <|endoftext|> two  spaces\n\nand [MASK] Café ÀB 中文"


def flags(*argv: str) -> TokenizerFlags:
    parser = argparse.ArgumentParser()
    add_tokenizer_args(parser)
    return TokenizerFlags.of(vars(parser.parse_args(argv)))


def test_gpt2_bpe_round_trips_and_matches_transformers():
    from transformers import GPT2TokenizerFast

    f = megatron_files()
    tok = GPT2BPETokenizer(f["vocab_json"], f["merges"])
    hf = GPT2TokenizerFast.from_pretrained(f["folder"])
    assert tok.vocab_size == len(hf) == GPT2_VOCAB
    assert tok.eod == hf.convert_tokens_to_ids("<|endoftext|>") and tok.pad is None
    for text in documents()[:8]:
        ids = tok.encode(text + ODD)
        assert ids == hf(text + ODD).input_ids
        assert tok.decode(ids) == text + ODD
    assert tok.encode("a<|endoftext|>b")[1] == tok.eod  # a special token, never split
    starts = tok.word_start[tok.encode(" owls sleeping")]
    assert starts[0] and tok.pieces()[tok.encode(" owls")[0]].startswith("\u0120")


@pytest.mark.parametrize("lower", [True, False])
def test_wordpiece_matches_transformers_with_special_ids(lower):
    from transformers import BertTokenizerFast

    f = megatron_files()
    tok = (BertWordPieceLowerCase if lower else BertWordPieceCase)(f["vocab_txt"])
    hf = BertTokenizerFast.from_pretrained(f["root"], do_lower_case=lower)  # its vocab.txt
    assert tok.vocab_size == len(hf) == BERT_VOCAB
    vocab = hf.get_vocab()
    assert (tok.cls, tok.sep, tok.mask, tok.pad, tok.unk) == tuple(
        vocab[t] for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]"))
    assert tok.eod == tok.sep
    for text in documents()[:8]:
        assert tok.encode(text + ODD) == hf(text + ODD, add_special_tokens=False).input_ids
    ids = tok.encode("The Café")
    assert (tok.decode(ids) == "the cafe") if lower else (tok.unk in ids)
    pieces = tok.pieces()
    assert all(tok.word_start[i] != pieces[i].startswith("##") for i in range(tok.vocab_size)
               if i not in tok.special_ids)


def test_null_tokenizer_is_megatrons():
    tok = NullTokenizer(100)
    assert (tok.vocab_size, tok.eod, tok.pad, tok.cls, tok.mask) == (100, 99, None, None, None)
    assert tok.encode("5 17 3") == [5, 17, 3] and tok.decode([5, 17, 3]) == "5 17 3"
    assert NullTokenizer(100, eod=0, pad=1).special_ids == [0, 1]
    assert NullTokenizer(100, pad=-1).pad is None  # Megatron's default --null-tokenizer-pad-id
    with pytest.raises(ValueError, match="ids 3..100 outside its vocabulary of 100"):
        tok.encode("3 100")
    with pytest.raises(ValueError, match="space-separated token ids"):
        tok.encode("the cat")
    with pytest.raises(ValueError, match="eod id 100 lies outside its vocabulary of 100"):
        NullTokenizer(100, eod=100)
    assert NullTokenizer(100).sha256 == tok.sha256 != NullTokenizer(101).sha256


def sentencepiece_model(folder) -> str:
    """A 200-piece sentencepiece BPE with BOS (id 1) and EOS (id 2), as Llama's."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(documents()[:10]), model_prefix=str(folder / "sp"),
                                   vocab_size=200, minloglevel=2, num_threads=1)
    return str(folder / "sp.model")


def test_references_reload_every_kind(tmp_path):
    f = megatron_files()
    sp = sentencepiece_model(tmp_path)
    tokenizers = [GPT2BPETokenizer(f["vocab_json"], f["merges"]), BertWordPieceLowerCase(f["vocab_txt"]),
                  BertWordPieceCase(f["vocab_txt"]), NullTokenizer(64, pad=0), SentencePieceTokenizer(sp),
                  SentencePieceTokenizer(sp, bos=True), HFTokenizer(f["folder"])]
    text = "The clever fox hides near the river."
    for tok in tokenizers:
        sample = "5 17 3" if tok.kind == "NullTokenizer" else text
        ref = tok.reference()
        for again in (load_tokenizer(**ref), pickle.loads(pickle.dumps(tok)), recorded_tokenizer(ref)):
            assert type(again) is type(tok) and again.reference() == ref
            assert again.encode(sample) == tok.encode(sample)
    # references written before the Megatron kinds (kind, path, sha256, vocab_size) still load
    old = {"kind": "sentencepiece", "path": sp, "sha256": tokenizers[4].sha256, "vocab_size": 200}
    assert load_tokenizer(**old).encode(text) == tokenizers[4].encode(text)
    llama = tokenizers[5]  # Llama2Tokenizer: the model's BOS first; eod is its EOS
    assert llama.encode(text) == [1] + tokenizers[4].encode(text) and llama.eod == 2
    moved = dict(tokenizers[0].reference(), merge_file=str(tmp_path / "gone.txt"))
    assert recorded_tokenizer(moved) is None  # its files are not on this machine
    with pytest.raises(ValueError, match="not the recorded"):
        load_tokenizer(**dict(tokenizers[0].reference(), sha256="0" * 64))
    with pytest.raises(ValueError, match="tokenizer kind 'Tiktoken' is unknown"):
        load_tokenizer(kind="Tiktoken", path=sp)


def test_flags_pick_megatrons_tokenizer(tmp_path):
    f = megatron_files()
    sp = sentencepiece_model(tmp_path)
    cases = {  # Megatron-LM's examples give no --tokenizer-type: the files say which
        ("--vocab-file", f["vocab_json"], "--merge-file", f["merges"]): GPT2BPETokenizer,
        ("--vocab-file", f["vocab_txt"]): BertWordPieceLowerCase,
        ("--tokenizer-type", "BertWordPieceCase", "--vocab-file", f["vocab_txt"]): BertWordPieceCase,
        ("--tokenizer-type", "NullTokenizer", "--vocab-size", "32", "--null-tokenizer-eod-id", "0"): NullTokenizer,
        ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f["folder"]): HFTokenizer,
        ("--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp):
            SentencePieceTokenizer,
        ("--tokenizer-model", sp): SentencePieceTokenizer,
    }
    for argv, cls in cases.items():
        assert type(tokenizer_of(flags(*argv))) is cls, argv
    assert tokenizer_of(flags("--tokenizer-type", "NullTokenizer", "--vocab-size", "32",
                                     "--null-tokenizer-eod-id", "0")).eod == 0
    assert tokenizer_of(flags()) is None  # the data's own tokenizer
    errors = {
        ("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"): "GPT2BPETokenizer lacks --merge-file",
        ("--tokenizer-type", "NullTokenizer"): "NullTokenizer lacks --vocab-size",
        ("--tokenizer-type", "BertWordPieceCase", "--vocab-file", "v", "--merge-file", "m"):
            "BertWordPieceCase does not read --merge-file",
        ("--merge-file", "m.txt"): "--merge-file needs --vocab-file",
        ("--vocab-size", "9"): "--vocab-size is NullTokenizer's; add --tokenizer-type NullTokenizer",
        ("--vocab-file", "v.json", "--merge-file", "m", "--null-tokenizer-eod-id", "0"):
            "GPT2BPETokenizer does not read --null-tokenizer-eod-id",
        ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", HUB_NAME): "tpzoo downloads nothing",
    }
    for argv, fragment in errors.items():
        with pytest.raises((ValueError, FileNotFoundError), match=fragment):
            tokenizer_of(flags(*argv))


def test_vocabulary_smaller_than_the_data(tmp_path):
    prefix = str(tmp_path / "megatron_text_document")  # no tpzoo metadata, as Megatron-LM writes it
    with IndexedDatasetBuilder(prefix, 1000) as builder:
        builder.add_document(np.array([1, 700, 3]))
        builder.finalize()
    data = IndexedDataset(prefix)
    check_data_tokenizer(data, NullTokenizer(701))
    with pytest.raises(ValueError, match="holds token ids up to 700 but the tokenizer .* vocabulary of 700"):
        check_data_tokenizer(data, NullTokenizer(700))
    f = megatron_files()
    with pytest.raises(ValueError, match=f"ids up to 700 .* {f['vocab_txt']} has a vocabulary of {BERT_VOCAB}"):
        check_data_tokenizer(data, BertWordPieceLowerCase(f["vocab_txt"]))
