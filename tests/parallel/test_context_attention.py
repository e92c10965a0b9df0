"""Context-parallel attention (``tpzoo.parallel.context_attention``), ring (p2p) and all-to-all (a2a), equals attention
over the whole sequence in one process: outputs and the gradients of queries, keys and values within 1e-5 in float32,
at cp 2 and 4 (one spawn of 4 gloo ranks), with the load-balanced cut of a causal sequence (rank r holds chunks r and
2c-1-r of 2c), a sliding window, packed documents, padding, and a query that sees no key at all (zeros, finite
gradients). Each check is its own test case (``cases``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from cases import CaseLog, assert_case

from tpzoo.parallel.context_attention import MODES
from tpzoo.placement import Placement, hidden
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")

B, N, S, D = 2, 4, 16, 8

# (name, causal, balanced cut, window, documents, padding)
KINDS = [("causal", True, True, None, False, False), ("causal-contiguous", True, False, None, False, False),
         ("window", True, True, 3, False, False), ("documents", True, True, None, True, False),
         ("bidirectional-padding", False, False, None, False, True),
         ("bidirectional-documents-padding", False, False, None, True, True),
         ("no-key-seen", False, False, None, False, "all")]
CPS = (2, 4)
NAMES = [name for cp in CPS for name in [*(f"{kind[0]}-{mode}-cp{cp}" for mode in MODES for kind in KINDS),
                                          f"dropout-p2p-cp{cp}"]]


def held(s: int, cp: int, rank: int, balanced: bool) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` holds: chunks r and 2cp-1-r of 2cp, or the r-th of cp."""
    if not balanced:
        return torch.arange(rank * s // cp, (rank + 1) * s // cp)
    c = s // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def inputs(padding, documents: bool) -> tuple[list[torch.Tensor], Placement]:
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(B, N, S, D, generator=g) for _ in range(3)]
    doc = torch.cumsum(torch.rand(B, S, generator=g) < 0.2, 1) if documents else None
    valid = None
    if padding:
        valid = torch.ones(B, S, dtype=torch.bool)
        valid[0, -5:] = False  # right padding
        valid[1, :3] = False   # left padding
        if padding == "all":
            valid[1] = False   # a sequence of padding only: its queries see no key
    return qkv, Placement(torch.arange(S), doc, valid)


def reference(qkv: list[torch.Tensor], placed: Placement, causal: bool, window: int | None) -> torch.Tensor:
    """Attention over the whole sequence in one process, a dense mask; a query that sees no key: zeros."""
    q, k, v = qkv
    mask = hidden(placed, placed, causal, window)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    if mask is None:
        return torch.softmax(scores, -1) @ v
    probs = torch.softmax(scores.masked_fill(mask, torch.finfo(scores.dtype).min), -1)
    return (probs * (~mask).any(-1, keepdim=True)) @ v


def check(log: CaseLog, group: dist.ProcessGroup, mode: str, kind: tuple) -> None:
    _, causal, balanced, window, documents, padding = kind
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    qkv, placed = inputs(padding, documents)
    full = [t.clone().requires_grad_() for t in qkv]
    expected = reference(full, placed, causal, window)
    expected.backward(torch.cos(expected.detach()))
    mine = held(S, cp, rank, balanced)
    local = [t[:, :, mine].clone().requires_grad_() for t in qkv]
    where = Placement(mine, None if placed.doc is None else placed.doc[:, mine],
                      None if placed.valid is None else placed.valid[:, mine])
    out = MODES[mode](*local, where, group=group, causal=causal, window=window)
    out.backward(torch.cos(out.detach()))
    log.close(out, expected[:, :, mine], "output", "output")
    for name, a, b in zip("qkv", local, full):
        assert torch.isfinite(a.grad).all(), f"d{name} is not finite"
        log.close(a.grad, b.grad[:, :, mine], f"d{name}", "gradients")


def check_dropout(log: CaseLog, group: dist.ProcessGroup) -> None:
    """With dropout, ring attention's backward draws each block's mask again: the gradient along a random direction
    equals the central difference of the loss (summed over the ranks) with the same masks (the seed set before each
    forward); a backward with other masks would miss it by far more than the tolerance."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    qkv, placed = inputs(False, True)
    mine = held(S, cp, rank, True)
    where = Placement(mine, placed.doc[:, mine])
    local = [t[:, :, mine].clone() for t in qkv]
    direction = [torch.randn(t.shape, generator=torch.Generator().manual_seed(rank + 9)) for t in local]
    weight = torch.cos(torch.arange(local[0].numel(), dtype=torch.float32)).reshape(local[0].shape)

    def loss(tensors: list[torch.Tensor]) -> torch.Tensor:
        torch.manual_seed(5)
        return (MODES["p2p"](*tensors, where, group=group, causal=True, dropout=0.3) * weight).sum()

    inputs_ = [t.clone().requires_grad_() for t in local]
    loss(inputs_).backward()
    slope = torch.stack([sum((t.grad * u).sum() for t, u in zip(inputs_, direction))])
    h = 1e-2
    with torch.no_grad():
        up, down = (loss([t + sign * h * u for t, u in zip(local, direction)]) for sign in (1, -1))
    numeric = torch.stack([(up - down) / (2 * h)])
    for value in (slope, numeric):
        dist.all_reduce(value, group=group)
    log.close(slope, numeric, "gradient along a direction, with dropout", "dropout", 2e-3)


def ring_checks() -> CaseLog:
    log = CaseLog()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]}
    for cp in CPS:
        for mode in MODES:
            for kind in KINDS:
                with log.case(f"{kind[0]}-{mode}-cp{cp}"):
                    check(log, groups[cp], mode, kind)
        with log.case(f"dropout-p2p-cp{cp}"):
            check_dropout(log, groups[cp])
    dist.destroy_process_group()
    return log


@pytest.fixture(scope="module")
def logs() -> list[CaseLog]:
    return spawn(ring_checks, 4)


def test_every_check_has_a_case(logs):
    assert logs[0].ran == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_ring_attention_equals_whole_sequence_attention(logs, name):
    assert_case(logs, name)


@pytest.mark.tier("unit")
def test_each_cp_rank_draws_its_own_dropout_streams():
    """The cp ranks hold different tokens: each its own default and tp streams; at cp rank 0 (and cp 1) the streams
    are the ones tpzoo always drew (seed + 100 pp_rank)."""
    from types import SimpleNamespace

    from tpzoo.parallel import manual_seed
    from tpzoo.parallel.random import RNGStatesTracker

    draws = {}
    for cp_rank in (0, 1):
        mesh = SimpleNamespace(pp_rank=1, tp_rank=0, cp_rank=cp_rank, device=torch.device("cpu"),
                               rng=RNGStatesTracker())
        manual_seed(7, mesh)
        draws[cp_rank] = torch.rand(4)
    torch.manual_seed(7 + 100)
    assert torch.equal(draws[0], torch.rand(4)) and not torch.equal(draws[0], draws[1])
