"""GPT samples: windows of the shuffled document stream, next-token labels, seeded determinism,
epochs, splits, and the trainer helpers."""

import pickle

import numpy as np
import pytest
import torch
from data_helpers import corpus_files, small_corpus

from tpzoo.data.build import build_datasets, parse_split, samples_needed, split_documents
from tpzoo.data.gpt_dataset import GPTDataset, permutation
from tpzoo.data.indexed import IndexedDataset
from tpzoo.data.preprocess import preprocess
from tpzoo.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.tier("unit")




@pytest.fixture(scope="module")
def gpt_data(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("causal-lm") / "documents")
    preprocess(corpus_files(), prefix, small_corpus()["tokenizer"], append_eod=True, progress=False)
    return prefix


def test_windows_follow_the_shuffled_stream(gpt_data):
    data, s = IndexedDataset(gpt_data), 32
    docs = np.arange(10, 150)
    ds = GPTDataset(data, docs, s, num_samples=900, seed=5)
    tokens_per_epoch = int(data.document_lengths[docs].sum())
    assert ds.epochs == -(-(ds.block * -(-900 // ds.block) * s + 1) // tokens_per_epoch) and ds.epochs > 1
    for e in range(ds.epochs):  # each epoch holds every document of the split once, in its own order
        epoch_docs = ds.doc_order[e * len(docs) : (e + 1) * len(docs)]
        assert sorted(epoch_docs) == docs.tolist()
    stream = np.concatenate([data.document(d) for d in ds.doc_order])
    eod = load_tokenizer(small_corpus()["tokenizer"]).eod
    seen = []
    for i in range(900):
        sample = ds[i]
        assert sample["input_ids"].dtype == sample["labels"].dtype == torch.int64
        assert sample["input_ids"].shape == sample["labels"].shape == (s,)
        assert torch.equal(sample["input_ids"][1:], sample["labels"][:-1])  # labels are the next tokens
        window = torch.cat([sample["input_ids"], sample["labels"][-1:]]).numpy()
        block, r = divmod(i, ds.block)
        j = block * ds.block + int(permutation(ds.block, 5, 0, 1, block)[r])
        assert np.array_equal(window, stream[j * s : j * s + s + 1])
        seen.append(j)
    full_blocks = 900 // ds.block * ds.block
    assert sorted(seen[:full_blocks]) == list(range(full_blocks))  # every window once per block
    assert (stream == eod).sum() == ds.epochs * len(docs)  # documents are joined by end-of-document
    with pytest.raises(IndexError):
        ds[900]


def test_same_seed_same_samples_and_prefix_stable(gpt_data):
    data = IndexedDataset(gpt_data)
    a = GPTDataset(data, range(160), 16, 300, seed=1)
    b = GPTDataset(IndexedDataset(gpt_data), range(160), 16, 3000, seed=1)  # more samples asked
    c = GPTDataset(data, range(160), 16, 300, seed=2)
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(300))
    assert sum(torch.equal(a[i]["input_ids"], c[i]["input_ids"]) for i in range(300)) < 5
    copy = pickle.loads(pickle.dumps(a))  # as DataLoader workers receive it
    assert all(torch.equal(copy[i]["labels"], a[i]["labels"]) for i in (0, 123, 299))


def test_build_datasets_splits(gpt_data):
    tok = load_tokenizer(small_corpus()["tokenizer"])
    train, valid, test = build_datasets("causal-lm", tok, gpt_data, 16, 1234, (64, 8, 0), split="90,10,0")
    assert test is None and (len(train), len(valid)) == (64, 8)
    assert set(train.doc_order) == set(range(144)) and set(valid.doc_order) == set(range(144, 160))
    assert not torch.equal(train[0]["input_ids"], valid[0]["input_ids"])
    with pytest.raises(ValueError, match="the test split .* has no documents; change --split"):
        build_datasets("causal-lm", tok, gpt_data, 16, 1234, (64, 8, 8), split="90,10,0")
    with pytest.raises(ValueError, match="model must be one of"):
        build_datasets("t5", tok, gpt_data, 16, 1234, (64, 8, 8))


def test_gpt_needs_end_of_document_tokens(tmp_path):
    prefix = str(tmp_path / "no_eod")
    preprocess(corpus_files()[0], prefix, small_corpus()["tokenizer"], progress=False)
    tok = load_tokenizer(small_corpus()["tokenizer"])
    with pytest.raises(ValueError, match="without --append-eod.*again with --append-eod"):
        build_datasets("causal-lm", tok, prefix, 16, 1234, (64, 0, 0))


def test_split_helpers():
    assert parse_split("98,1,1") == pytest.approx([0.98, 0.01, 0.01])
    assert parse_split("2/1") == pytest.approx([2 / 3, 1 / 3, 0])
    for bad in ("a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(ValueError, match="must be up to three non-negative weights"):
            parse_split(bad)
    parts = split_documents(1000, "98,1,1")
    assert [len(p) for p in parts] == [980, 10, 10] and np.array_equal(np.concatenate(parts), np.arange(1000))
    assert [len(p) for p in split_documents(7, "1,1,1")] == [2, 3, 2]
    assert samples_needed(100, 8, 50, 2) == (800, 48, 16)
    assert samples_needed(100, 8, 0, 2) == (800, 0, 16)
