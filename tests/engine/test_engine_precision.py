"""Mixed precision in the engine (``tpzoo.engine.mixed_precision``), and issue 14's acceptance.

One 8-rank spawn on (tp, pp, dp) = (2, 2, 2) checks, each a named case (``pytest -k bf16``): fp16
skips an injected overflow on every rank; bf16 weights (Megatron-style: float32 main weights in the
optimizer) track the float32 single-rank losses on two schedules; the model's weights are bf16, the
optimizer's float32, and ZeRO-2 gives each dp rank about 1/dp of the main weights; a bf16 step casts
no weight matrix (autocast cast every weight on every micro-batch); a step reads tensors to the host
once at every precision.

The acceptance: pretraining with bf16 weights tracks the float32 run's loss curve within 1% at every
step over 50 steps of the demo corpus. pretrain.py runs twice, both at once, one process each (~30 s
on 2 cores); the largest difference measured is 0.40% (step 13), while the loss falls from 6.27 to 3.59.
"""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path
from typing import Iterator
from unittest import mock

import background
import pytest
import torch
import torch.distributed as dist
from cases import CaseLog, assert_case
from doc_helpers import run_as_needed
from pretrain_helpers import command, metrics, rel
from test_engine import PRETRAINING, global_batch, ref_key, reference, train
from torch.utils._python_dispatch import TorchDispatchMode

from tpzoo.engine import train_step
from tpzoo.parallel import init_mesh

pytestmark = pytest.mark.tier("journey")



# vs the float32 losses, measured: bf16 2e-5; fp16 2.2e-3 (its first step is skipped: one update behind)
BF16_TOL = 1e-2
PRECISION_CASES = ("fp16-overflow-skips-on-every-rank", "bf16-tracks-fp32-interleaved-1f1b-zero2-sp",
                   "bf16-tracks-fp32-interleaved-zero-bubble", "bf16-weights-fp32-main-zero2-shards-main",
                   "bf16-step-casts-no-weight-matrix",
                   *(f"one-host-sync-per-step-{p}" for p in ("fp32", "bf16", "fp16")))


class WeightCasts(TorchDispatchMode):
    """Counts copies of the model weights ``params`` (at least 2-D: what matmuls read) into another dtype
    (``aten._to_copy``, what autocast does to every weight on every micro-batch)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.weights = {p.data_ptr() for p in params if p.dim() >= 2}
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.weights:
            self.casts += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_syncs(optimizer: torch.optim.Optimizer) -> Iterator[list[str]]:
    """The names of the tensor methods that read a tensor to the host (a host-device sync on a GPU), one
    entry per call made inside the block, but for those of two calls that read host tensors by design:
    ``optimizer.step`` (on CPU, foreach AdamW reads its step counts; on CUDA the engine's fused AdamW keeps
    them on the device) and the engine's token-id check of the batch before it moves to the device."""
    calls: list[str] = []
    paused = []

    def counted(name: str, method):
        return lambda t, *args: (paused or calls.append(name), method(t, *args))[1]

    def pausing(fn):
        def call(*args, **kwargs):
            paused.append(True)
            try:
                return fn(*args, **kwargs)
            finally:
                paused.pop()
        return call

    with contextlib.ExitStack() as stack:
        for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, counted(name, getattr(torch.Tensor, name))))
        stack.enter_context(mock.patch.object(optimizer, "step", pausing(optimizer.step)))
        stack.enter_context(mock.patch("tpzoo.engine.train_step.check_token_ids",
                                       pausing(train_step.check_token_ids)))
        yield calls


def check_precision(refs: dict) -> CaseLog:
    """On (2, 2, 2), the GPT: fp16 skips an overflow on every rank; bf16 weights (Megatron-style) track the
    float32 losses on two schedules; model weights bf16, main weights float32 and split by ZeRO-2; no
    weight matrix is cast in a step; one host sync per step at every precision."""
    log, mesh, name = CaseLog(), init_mesh(tp=2, pp=2, dp=2), PRETRAINING[0]
    ref = refs[ref_key(name, 2)][0]  # the float32 single-rank losses

    def tracks(label: str, results, first: int = 0) -> None:
        for step, r in enumerate(results, first):
            log.close(torch.tensor(r.loss), torch.tensor(ref[step]), f"{label} step {step} loss", label, BF16_TOL)

    with log.case("fp16-overflow-skips-on-every-rank"):
        engine, _ = train(name, mesh, "1f1b", steps=0, precision="fp16")
        before = [p.detach().clone() for p in engine.params]
        hook = engine.params[0].register_hook(lambda g: g * float("inf")) if dist.get_rank() == 5 else None
        scale = engine.loss_scale
        first = engine.train_step(global_batch(name, 0))
        if hook is not None:
            hook.remove()
        assert first.skipped and engine.skipped_steps == 1 and engine.loss_scale == scale / 2, \
            f"rank {dist.get_rank()}: the overflow step was not skipped everywhere (scale {engine.loss_scale})"
        assert all(torch.equal(p, b) for p, b in zip(engine.params, before)), "a skipped step changed weights"
        fp16 = [engine.train_step(global_batch(name, step)) for step in range(1, 4)]
        assert not any(r.skipped for r in fp16) and {p.dtype for p in engine.params} == {torch.float16}
        tracks("fp16", fp16, 1)
    for schedule, options in (("interleaved-1f1b", dict(use_distributed_optimizer=True, sequence_parallel=True)),
                              ("interleaved-zero-bubble", {})):
        tag = f"bf16-tracks-fp32-{schedule}" + ("-zero2-sp" if options else "")
        with log.case(tag):
            engine, bf16 = train(name, mesh, schedule, steps=4, precision="bf16", **options)
            tracks("bf16", bf16)
    with log.case("bf16-weights-fp32-main-zero2-shards-main"):  # the last engine: ZeRO off; this one on (ZeRO-2)
        engine, _ = train(name, mesh, "1f1b", steps=1, precision="bf16", use_distributed_optimizer=True)
        assert {p.dtype for p in engine.params} == {torch.bfloat16}, "model weights are not bf16"
        stepped = [p for group in engine.optimizer.param_groups for p in group["params"]]
        assert {p.dtype for p in stepped} == {torch.float32}, "the optimizer steps non-float32 weights"
        held = torch.tensor([sum(p.untyped_storage().nbytes() for p in engine.main.params), 0])
        held[1] = sum(p.numel() * 4 for p in engine.params)
        total = held.clone()
        dist.all_reduce(total[:1], group=mesh.dp_group)
        assert abs(total[0] - held[1]) <= 4 * len(engine.params) * mesh.dp_size, \
            f"main weights over dp {total[0]} B != one float32 copy of the model, {held[1]} B"
        assert held[0] <= 1.5 * held[1] / mesh.dp_size + 1024, f"a rank holds {held[0]} B of {held[1]} B, not 1/dp"
    with log.case("bf16-step-casts-no-weight-matrix"):
        with WeightCasts(engine.params) as casts:
            engine.train_step(global_batch(name, 1))
        assert casts.casts == 0, f"a bf16 step cast weight matrices {casts.casts} times"
    for precision in ("fp32", "bf16", "fp16"):
        with log.case(f"one-host-sync-per-step-{precision}"):
            engine, _ = train(name, mesh, "1f1b", steps=1, precision=precision, use_distributed_optimizer=True)
            with counting_syncs(engine.optimizer) as calls:
                engine.train_step(global_batch(name, 1))
            assert calls == ["tolist"], f"a {precision} step read tensors to the host {len(calls)} times: {calls}"
    return log


@background.fixture
def precision_logs(tmp_path_factory) -> list[CaseLog]:
    name = PRETRAINING[0]
    refs = {ref_key(name, 2): background.spawn(reference, 1, name, 2)[0]}
    return background.spawn(check_precision, 8, refs, timeout=900)


@pytest.mark.parametrize("name", PRECISION_CASES)
def test_engine_mixed_precision(precision_logs, name):
    print({k: f"{v:.2e}" for k, v in precision_logs[0].max.items()})
    assert_case(precision_logs, name)


CURVE_STEPS = 50
FLAGS = (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --global-batch-size 16 "
         f"--micro-batch-size 4 --hidden-dropout 0 --attention-dropout 0 --lr 5e-3 --lr-warmup-iters 5 "
         f"--log-interval 1 --train-iters {CURVE_STEPS}").split()
CURVE_TOL = 0.01


@background.fixture
def curves(tmp_path_factory) -> Path:
    """The folder of the two runs, fp32 and bf16."""
    root = tmp_path_factory.mktemp("curves")
    run_as_needed([shlex.join(command(FLAGS + ["--save", "fp32"])),
                   shlex.join(command(FLAGS + ["--bf16", "--save", "bf16"]))], root)
    return root


def test_bf16_pretraining_tracks_fp32_loss_curve_within_1_percent(curves):
    fp32, bf16 = metrics(curves / "fp32"), metrics(curves / "bf16")
    assert sorted(fp32) == sorted(bf16) == list(range(1, CURVE_STEPS + 1))
    errors = {i: rel(bf16[i]["loss"], fp32[i]["loss"]) for i in fp32}
    worst = max(errors, key=errors.get)
    last = CURVE_STEPS
    print(f"bf16 vs fp32: largest relative loss difference {errors[worst]:.2e} at step {worst}; "
          f"loss {fp32[1]['loss']:.3f} -> {fp32[last]['loss']:.3f} (fp32), {bf16[last]['loss']:.3f} (bf16)")
    assert errors[worst] <= CURVE_TOL, f"step {worst}: bf16 loss {bf16[worst]['loss']} vs fp32 {fp32[worst]['loss']}"
    assert fp32[CURVE_STEPS]["loss"] < 4.0, "the run must learn (the corpus's unigram entropy is 5.19)"
