"""BERT samples: masking rates, whole-word masking, segment layout, next-sentence and
sentence-order labels, determinism, misuse."""

import pickle

import numpy as np
import pytest
import torch
from data_helpers import corpus_files, small_corpus

from tpzoo.data.bert_dataset import BertDataset
from tpzoo.data.demo import demo_data
from tpzoo.data.indexed import IndexedDataset
from tpzoo.data.preprocess import preprocess
from tpzoo.data.tokenizer import load_tokenizer
from tpzoo.models.config import IGNORE_INDEX

pytestmark = pytest.mark.tier("unit")



SEQ = 64


@pytest.fixture(scope="module")
def demo_bert():
    tok_path, prefix = demo_data("masked-lm")
    return load_tokenizer(tok_path), IndexedDataset(prefix)


def masking_rates(ds, num_tokens):
    """Counts over samples until ``num_tokens`` maskable tokens were seen."""
    tok = ds.tok
    counts = dict.fromkeys(("candidates", "masked", "mask", "random", "kept"), 0)
    i = 0
    while counts["candidates"] < num_tokens:
        x = ds[i]
        ids, labels = x["input_ids"], x["labels"]
        real = x["attention_mask"].bool()
        specials = (ids == tok.cls) | (ids == tok.sep) | (ids == tok.pad)
        original = torch.where(labels >= 0, labels, ids)
        counts["candidates"] += int((real & ~((original == tok.cls) | (original == tok.sep))).sum())
        m = labels != IGNORE_INDEX
        assert not (m & ~real).any() and not (m & specials & (ids != tok.mask)).any()
        counts["masked"] += int(m.sum())
        counts["mask"] += int((ids[m] == tok.mask).sum())
        counts["kept"] += int((ids[m] == labels[m]).sum())
        counts["random"] += int(((ids[m] != labels[m]) & (ids[m] != tok.mask)).sum())
        i += 1
    return {
        "masked": counts["masked"] / counts["candidates"],
        **{k: counts[k] / counts["masked"] for k in ("mask", "random", "kept")},
    }


def test_masking_rates_over_100k_tokens(demo_bert):
    tok, data = demo_bert
    ds = BertDataset(data, np.arange(data.num_documents), tok, 128, 5000, seed=3)
    rates = masking_rates(ds, 100_000)
    print(f"masking rates over 100k tokens: {rates}")
    assert rates["masked"] == pytest.approx(0.15, abs=0.005)
    assert rates["mask"] == pytest.approx(0.80, abs=0.005)
    assert rates["random"] == pytest.approx(0.10, abs=0.005)
    assert rates["kept"] == pytest.approx(0.10, abs=0.005)


def test_masking_rate_follows_masked_lm_prob(demo_bert):
    """pretrain.py's --mask-prob: the share of candidate tokens picked, the 80/10/10 split of them unchanged."""
    tok, data = demo_bert
    ds = BertDataset(data, np.arange(data.num_documents), tok, SEQ, 2000, seed=5, masked_lm_prob=0.4)
    rates = masking_rates(ds, 20_000)
    print(f"masking rates at masked_lm_prob 0.4: {rates}")
    assert rates["masked"] == pytest.approx(0.4, abs=0.01)
    assert rates["mask"] == pytest.approx(0.80, abs=0.01)


def test_whole_word_masking(demo_bert):
    tok, data = demo_bert
    ds = BertDataset(data, np.arange(data.num_documents), tok, SEQ, 400, seed=3, whole_word_masking=True)
    rates = masking_rates(ds, 20_000)
    print(f"whole-word masking rates: {rates}")
    assert rates["masked"] == pytest.approx(0.15, abs=0.01)
    for i in range(400):
        x = ds[i]
        m = (x["labels"] != IGNORE_INDEX).numpy()
        original = np.where(m, x["labels"].numpy(), x["input_ids"].numpy())
        n = int(x["attention_mask"].sum())
        for k in range(2, n - 1):  # a token that continues a word is masked exactly when its word start is
            if not tok.word_start[original[k]] and original[k - 1] != tok.sep:
                assert m[k] == m[k - 1]


def _segments(x, tok):
    n = int(x["attention_mask"].sum())
    original = torch.where(x["labels"] >= 0, x["labels"], x["input_ids"])[:n].tolist()
    seps = [k for k, t in enumerate(original) if t == tok.sep]
    return original, seps, n


@pytest.mark.parametrize("binary_head", ["sop", "nsp"])
def test_layout_and_binary_labels(demo_bert, binary_head):
    tok, data = demo_bert
    docs = np.arange(0, 3000)
    ds = BertDataset(data, docs, tok, SEQ, 300, seed=11, binary_head=binary_head)
    stream = data.tokens.astype(np.int64)
    labels, checked = [], 0
    for i in range(300):
        x = ds[i]
        original, seps, n = _segments(x, tok)
        assert original[0] == tok.cls and len(seps) == 2 and seps[1] == n - 1
        types = x["token_type_ids"].tolist()
        assert types == [0] * (seps[0] + 1) + [1] * (n - seps[0] - 1) + [0] * (SEQ - n)
        assert x["attention_mask"].tolist() == [1] * n + [0] * (SEQ - n)
        assert (x["input_ids"][n:] == tok.pad).all() and (x["labels"][n:] == IGNORE_INDEX).all()
        label = int(x["next_sentence_label"])
        labels.append(label)
        if n < SEQ:  # not truncated: the segments are whole sentences of the data
            a, b = original[1 : seps[0]], original[seps[0] + 1 : n - 1]
            first, second = (b, a) if binary_head == "sop" and label else (a, b)
            joined = np.array(first + second)
            contiguous = any(
                np.array_equal(stream[p : p + len(joined)], joined) for p in np.flatnonzero(stream == joined[0])
            )
            assert contiguous == (label == 0 or binary_head == "sop")
            checked += 1
    assert checked > 50 and 0.4 < np.mean(labels) < 0.6


def test_deterministic_by_seed(demo_bert):
    tok, data = demo_bert
    docs = np.arange(500)
    a, b = (BertDataset(data, docs, tok, SEQ, 50, seed=1) for _ in range(2))
    c = BertDataset(data, docs, tok, SEQ, 50, seed=2)
    copy = pickle.loads(pickle.dumps(a))  # as DataLoader workers receive it
    for i in range(50):
        assert all(torch.equal(a[i][k], b[i][k]) and torch.equal(a[i][k], copy[i][k]) for k in a[i])
    assert sum(torch.equal(a[i]["input_ids"], c[i]["input_ids"]) for i in range(50)) < 3
    no_head = BertDataset(data, docs, tok, SEQ, 5, seed=1, binary_head=None)
    x = no_head[0]  # one segment, no sentence task: nothing for a model without the binary head to refuse
    assert "next_sentence_label" not in x and (x["token_type_ids"] == 0).all()


def test_misuse(tmp_path, demo_bert):
    tok, data = demo_bert
    gpt_prefix = str(tmp_path / "documents")  # documents not split into sentences
    preprocess(corpus_files(), gpt_prefix, small_corpus()["tokenizer"], progress=False)
    small_tok = load_tokenizer(small_corpus()["tokenizer"])
    with pytest.raises(ValueError, match="needs a document of 2\\+ sentences; preprocess with --split-sentences"):
        BertDataset(IndexedDataset(gpt_prefix), range(160), small_tok, SEQ, 10, seed=1)
    with pytest.raises(ValueError, match="binary_head must be"):
        BertDataset(data, range(10), tok, SEQ, 10, seed=1, binary_head="yes")
    with pytest.raises(ValueError, match="needs two documents"):
        BertDataset(data, [0], tok, SEQ, 10, seed=1, binary_head="nsp")
    from test_data_tokenizer import make_gpt2_tokenizer

    bpe = load_tokenizer(make_gpt2_tokenizer(tmp_path / "bpe"))
    with pytest.raises(ValueError, match="lacks the BERT tokens \\['cls', 'sep', 'mask', 'pad'\\]"):
        BertDataset(data, range(10), bpe, SEQ, 10, seed=1)
