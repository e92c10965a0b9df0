"""Indexed datasets and preprocessing: exact round trips of tokens and boundaries, the file format,
every input format, worker-count independence, and misuse."""

import pickle
import struct

import numpy as np
import pytest
from data_helpers import corpus_docs, corpus_files, small_corpus
from families import CAUSAL_LM

from tpzoo.data.build import build_datasets, resolve_data
from tpzoo.data.indexed import IndexedDataset, IndexedDatasetBuilder, token_dtype
from tpzoo.data.preprocess import preprocess, split_sentences
from tpzoo.data.tokenizer import load_tokenizer, train_tokenizer

pytestmark = pytest.mark.tier("unit")




@pytest.mark.parametrize("vocab_size, dtype", [(256, np.uint8), (60_000, np.uint16), (70_000, np.int32)])
def test_builder_round_trip(tmp_path, vocab_size, dtype):
    assert token_dtype(vocab_size) is dtype
    gen = np.random.default_rng(0)
    docs = [[gen.integers(0, vocab_size, gen.integers(1, 30)) for _ in range(gen.integers(1, 5))] for _ in range(50)]
    prefix = str(tmp_path / "data")
    with IndexedDatasetBuilder(prefix, vocab_size) as builder:
        for sentences in docs:
            builder.add_document(np.concatenate(sentences), [len(s) for s in sentences])
        builder.add_document([])  # an empty document is skipped
        builder.finalize({"note": "x"})
    data = IndexedDataset(prefix)
    assert data.dtype == dtype and data.metadata == {"note": "x"}
    assert (data.num_documents, data.num_sequences) == (50, sum(map(len, docs)))
    sentences = [s for d in docs for s in d]
    assert all(np.array_equal(data.sequence(k), s) for k, s in enumerate(sentences))
    assert all(np.array_equal(data.document(d), np.concatenate(docs[d])) for d in range(50))
    assert np.array_equal(data.tokens, np.concatenate(sentences))
    assert data.document_lengths.tolist() == [sum(map(len, d)) for d in docs]
    assert np.shares_memory(data.document(3), data.tokens)  # views of the memory map, no copies
    again = pickle.loads(pickle.dumps(data))
    assert np.array_equal(again.document(7), data.document(7))


def test_megatron_layout(tmp_path):
    prefix = str(tmp_path / "m")
    with IndexedDatasetBuilder(prefix, 1000) as builder:
        builder.add_document([5, 6, 7], [2, 1])
        builder.add_document([8, 9])
        builder.finalize()
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 3, 3)  # version 1, uint16, 3 sequences, 2 docs + 1
    assert np.frombuffer(raw, np.int32, 3, 34).tolist() == [2, 1, 2]
    assert np.frombuffer(raw, np.int64, 3, 46).tolist() == [0, 4, 6]  # byte offsets
    assert np.frombuffer(raw, np.int64, 3, 70).tolist() == [0, 2, 3]
    assert np.fromfile(prefix + ".bin", np.uint16).tolist() == [5, 6, 7, 8, 9]


def test_reads_a_file_written_as_megatron_does(tmp_path):
    """No tpzoo metadata, int32 ids, and an empty document (Megatron keeps those)."""
    prefix = str(tmp_path / "meg")
    np.array([5, 6, 7, 8, 9], np.int32).tofile(prefix + ".bin")
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 3, 4))
        f.write(np.array([2, 1, 2], np.int32).tobytes() + np.array([0, 8, 12], np.int64).tobytes())
        f.write(np.array([0, 2, 2, 3], np.int64).tobytes())
    data = IndexedDataset(prefix)
    assert data.metadata == {} and data.dtype == np.int32 and data.num_documents == 3
    assert data.document_lengths.tolist() == [3, 0, 2]
    assert [data.document(d).tolist() for d in range(3)] == [[5, 6, 7], [], [8, 9]]
    data.check_tokenizer(load_tokenizer(small_corpus()["tokenizer"]))  # nothing recorded, nothing to refuse


def test_builder_misuse(tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(ValueError, match=r"must lie in \[0, 10\)"):
        with IndexedDatasetBuilder(prefix, 10) as builder:
            builder.add_document([3, 10])
    assert not list(tmp_path.iterdir())  # the partial files are gone
    with pytest.raises(ValueError, match="sum to 2 but the document has 3"):
        IndexedDatasetBuilder(prefix, 10).add_document([1, 2, 3], [1, 1])
    with pytest.raises(FileNotFoundError, match="x.bin and .*x.idx not found"):
        IndexedDataset(prefix)
    (tmp_path / "x.bin").write_bytes(b"")
    (tmp_path / "x.idx").write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match="bad header"):
        IndexedDataset(prefix)


def test_preprocess_round_trip(tmp_path):
    """Every format is read; decoding gives back each document's tokens and sentences exactly."""
    tok = load_tokenizer(small_corpus()["tokenizer"])
    docs = corpus_docs()
    gpt, bert = str(tmp_path / "documents"), str(tmp_path / "sentences")
    stats = preprocess(corpus_files(), gpt, tok, append_eod=True, progress=False)
    preprocess(corpus_files(), bert, tok, split_sentences=True, progress=False)
    g, b = IndexedDataset(gpt), IndexedDataset(bert)
    assert stats["documents"] == g.num_documents == b.num_documents == len(docs) == 160
    assert g.num_sequences == 160 and stats["tokens"] == g.num_tokens == b.num_tokens + 160
    assert g.metadata["tokenizer"] == tok.reference() and b.metadata["split_sentences"]
    for d, text in enumerate(docs):
        assert g.document(d).tolist() == tok.encode(text) + [tok.eod]
        sentences = split_sentences(text)
        first, end = b.document_indices[d], b.document_indices[d + 1]
        assert [b.sequence(k).tolist() for k in range(first, end)] == [tok.encode(s) for s in sentences]
        assert [tok.decode(b.sequence(k)) for k in range(first, end)] == sentences
    assert tok.decode(g.tokens[: len(g.document(0)) - 1]) == docs[0]


@pytest.mark.tier("distributed")
def test_workers_do_not_change_the_output(tmp_path):
    tok = small_corpus()["tokenizer"]
    for workers in (1, 2):
        preprocess(
            corpus_files(),
            str(tmp_path / f"w{workers}"),
            tok,
            workers=workers,
            split_sentences=True,
            append_eod=True,
            batch_size=16,
            progress=False,
        )
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()


def test_split_sentences():
    assert split_sentences('He said "Stop!" Then left. Does it?  Yes.\nNew line') == [
        'He said "Stop!"',
        "Then left.",
        "Does it?",
        "Yes.",
        "New line",
    ]


def test_preprocess_misuse(tmp_path):
    tok = small_corpus()["tokenizer"]
    with pytest.raises(FileNotFoundError, match="missing.jsonl' does not exist"):
        preprocess(str(tmp_path / "missing.jsonl"), str(tmp_path / "o"), tok)
    with pytest.raises(ValueError, match="key 'body' is not in .*keys \\['id', 'text'\\]"):
        preprocess(corpus_files()[0], str(tmp_path / "o"), tok, json_key="body")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="is empty"):
        preprocess(str(empty), str(tmp_path / "o"), tok, progress=False)
    assert not list(tmp_path.glob("o.*"))
    (tmp_path / "notes.docx").write_text("x")
    with pytest.raises(ValueError, match="suffix must be one of"):
        preprocess(str(tmp_path / "notes.docx"), str(tmp_path / "o"), tok)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        preprocess(corpus_files()[0], str(tmp_path / "o"), tok, workers=0)


def test_tokenizer_must_match_the_dataset(tmp_path):
    tok = load_tokenizer(small_corpus()["tokenizer"])
    prefix = str(tmp_path / "documents")
    preprocess(corpus_files()[0], prefix, tok, append_eod=True, progress=False)
    found, _ = resolve_data("causal-lm", data_path=prefix)  # the recorded tokenizer is found
    assert found.sha256 == tok.sha256
    other = load_tokenizer(train_tokenizer(corpus_files(), str(tmp_path / "other"), 280))
    with pytest.raises(ValueError, match="was tokenized with .*tok.model.*other.model.*matching --tokenizer-model"):
        resolve_data("causal-lm", data_path=prefix, tokenizer_model=other.path)
    with pytest.raises(ValueError, match="was tokenized with"):
        build_datasets("causal-lm", other, prefix, 16, 1, (4, 0, 0))
    # the demo corpus with another tokenizer: tokenized again with it, into the cache
    found, demo = resolve_data(CAUSAL_LM.family, tokenizer_model=other.path, cache_path=str(tmp_path / "cache"))
    assert found.sha256 == other.sha256 and IndexedDataset(demo).metadata["tokenizer"]["sha256"] == other.sha256
