"""Samples are a pure function of (seed, index): read by 8 ranks of a tp=2 x dp=4 mesh, each
taking its slice of every global batch, they equal the samples one process reads."""

import numpy as np
import pytest
import torch

from tpzoo.data.build import build_datasets, resolve_data
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")



SEQ, GLOBAL_BATCH, ITERS, SEED = 32, 16, 3, 1234


def datasets(train_iters):
    out = {}
    for model in ("causal-lm", "masked-lm"):  # the data kinds
        tok, prefix = resolve_data(model)
        out[model] = build_datasets(model, tok, prefix, SEQ, SEED, (train_iters * GLOBAL_BATCH, 0, 0))[0]
    return out


def read_my_slices(tp, dp):
    """On one rank: the samples of this rank's micro-batches for iterations 0..ITERS-1."""
    import os

    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)  # the global generators must not matter
    np.random.seed(rank)
    dp_rank, micro = rank // tp, GLOBAL_BATCH // dp
    data = datasets(train_iters=ITERS)
    out = {}
    for k in range(ITERS):
        for i in range(k * GLOBAL_BATCH + dp_rank * micro, k * GLOBAL_BATCH + (dp_rank + 1) * micro):
            out[i] = {model: {key: t.tolist() for key, t in ds[i].items()} for model, ds in data.items()}
    return out


def test_samples_are_the_same_on_1_and_8_ranks():
    per_rank = spawn(read_my_slices, 8, tp=2, dp=4, timeout=240)
    data = datasets(train_iters=10)  # a longer run (as after a resume with more iterations)
    assert per_rank[0] == per_rank[1] and per_rank[0] != per_rank[2]  # tp peers read the same slice
    merged = {i: s for r in per_rank for i, s in r.items()}
    assert sorted(merged) == list(range(ITERS * GLOBAL_BATCH))
    for i, sample in merged.items():
        for model, ds in data.items():
            assert sample[model] == {key: t.tolist() for key, t in ds[i].items()}, (model, i)
