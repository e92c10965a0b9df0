"""No host-device synchronisation inside forward and backward: the tensor methods that wait for the
device (``item``, ``bool``, ``int``, ``float``, an index, ``tolist``, ``numpy``, ``cpu``, ``nonzero``)
are counted (patched on torch.Tensor, so the autograd functions' backward is seen too) over forward
and backward of every case of ``families.CASES`` at tp 1 (both attention backends; a mixture of experts' experts
as one grouped multiply, ``ParallelPlan.grouped_gemm``) and of
``families.MAIN`` at tp 2 with sequence parallelism and recompute (one spawn of 2 ranks): zero.
The host-side id check (``check_token_ids``) and the device-side one are checked here too.
(On a GPU, tests/gpu/test_gpu_no_sync.py runs the families under torch.cuda.set_sync_debug_mode.)
"""

from __future__ import annotations

import functools
import re
import traceback

import pytest
import torch
from families import CASES, MAIN, batch, without_labels

from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed
from tpzoo.parallel.token_ids import check_token_ids
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")



B, S, VOCAB = 2, 8, 101
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=VOCAB,
            max_position_embeddings=16, hidden_dropout=0.1, attention_dropout=0.1)
SYNCING = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy", "cpu", "nonzero")


def count_syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patch the ``SYNCING`` methods of torch.Tensor to record "method at file:line" of each call."""
    calls: list[str] = []
    for method in SYNCING:
        original = getattr(torch.Tensor, method)

        @functools.wraps(original)
        def counted(self, *args, _original=original, _method=method, **kwargs):
            where = traceback.extract_stack(limit=2)[0]
            calls.append(f"{_method} at {where.filename}:{where.lineno}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    return calls


def syncs_of(name: str, plan: ParallelPlan) -> list[str]:
    """The syncing calls of one training forward (with labels) and backward of case ``name``."""
    case = CASES[name]
    config = case.config(**TINY, **({"num_labels": 3} if case.inputs == "classification" else {}))
    model = case.build(config, plan)
    manual_seed(0, plan.mesh)
    g = torch.Generator().manual_seed(0)
    kwargs = batch(case, torch.randint(0, VOCAB, (B, S), generator=g), g)
    kwargs = {**without_labels(kwargs), **{key: kwargs[key] for key in model.label_keys}}
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = count_syncs(monkeypatch)
        out = model(**kwargs)
        sum(part.sum() for part in (out if isinstance(out, tuple) else (out,))).backward()
    return calls


@pytest.mark.tier("unit")
def test_the_counter_sees_syncs_in_forward_and_backward(monkeypatch):
    """The check can fail: a bool() in a forward and an item() in an autograd backward are counted."""

    class Syncing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            grad.sum().item()
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    calls = count_syncs(monkeypatch)
    y = Syncing.apply(x)
    bool(y.all())
    y.sum().backward()
    assert [c.split()[0] for c in calls] == ["__bool__", "item"], calls


ATTENTION = ("sdpa", "fused-softmax")


def no_sync_at_tp1() -> tuple[dict[tuple[str, str], list[str]], str]:
    """In a 1-rank spawn (init_mesh starts a process group, which must not outlive the test): the reads of
    every family under each attention backend, and the device-side assertion's message for a bad id."""
    mesh = init_mesh(tp=1)
    syncs = {(name, attention): syncs_of(name, ParallelPlan(mesh, kernels="torch", attention_backend=attention,
                                                             grouped_gemm=True))
             for name in CASES for attention in ATTENTION}
    model = CASES[MAIN[0]].build(CASES[MAIN[0]].config(**TINY), ParallelPlan(mesh, kernels="torch"))
    try:
        model(torch.tensor([[1, 101]]))
    except RuntimeError as e:  # torch._assert_async, on the CPU
        return syncs, str(e)
    return syncs, "no error"


@pytest.fixture(scope="module")
def tp1() -> tuple[dict[tuple[str, str], list[str]], str]:
    return spawn(no_sync_at_tp1, 1)[0]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", list(CASES))
def test_no_sync_at_tp1(tp1, name, attention):
    # a mixture of experts' experts run as one grouped multiply (the loop over them reads the token counts on the
    # host, by design); with a capacity factor each layer reads how many slots it kept (tpzoo.models.moe)
    config = CASES[name].config(**TINY)
    expected = ["__int__"] * config.num_layers if getattr(config, "moe_expert_capacity_factor", None) else []
    assert [sync.split(" at ")[0] for sync in tp1[0][name, attention]] == expected


def no_sync_at_tp2() -> dict[str, list[str]]:
    plan = ParallelPlan(init_mesh(tp=2), kernels="torch", sequence_parallel=True, recompute_activations=True)
    return {name: syncs_of(name, plan) for name in MAIN}


@pytest.fixture(scope="module")
def tp2_syncs() -> dict[str, list[str]]:
    return spawn(no_sync_at_tp2, 2)[0]


@pytest.mark.parametrize("name", MAIN)
def test_no_sync_at_tp2_with_sequence_parallelism_and_recompute(tp2_syncs, name):
    assert tp2_syncs[name] == []


def test_token_ids_checked_on_the_host_and_on_the_device(tp1):
    check_token_ids(torch.tensor([[0, 100]]), VOCAB, "input_ids")
    check_token_ids(torch.tensor([[-100, 3]]), VOCAB, "labels", ignore_index=-100)
    with pytest.raises(IndexError, match=r"input_ids must lie in \[0, 101\); got -1\.\.130"):
        check_token_ids(torch.tensor([[5, 130, -1, 101]]), VOCAB, "input_ids")
    with pytest.raises(IndexError, match=r"labels must lie in \[0, 101\) or equal ignore_index=-100; got 101\.\.101"):
        check_token_ids(torch.tensor([[-100, 101]]), VOCAB, "labels", ignore_index=-100)
    with pytest.raises(TypeError, match="input_ids must be an int32/int64 tensor, got torch.float32"):
        check_token_ids(torch.zeros(2), VOCAB, "input_ids")
    assert re.search(r"token ids must lie in \[0, 101\)", tp1[1]), tp1[1]
