"""The fused (vocab-parallel) cross entropy against F.cross_entropy in float64, both backends.

Triton runs through its interpreter in chunks of 8 columns (launch.MAX_BLOCK lowered), so rows
span several chunks, the last one partial. Cases: ignored targets (a whole sequence ignored),
label smoothing, ignore_index inside the vocabulary, padded vocabulary columns holding huge logits
(which must not count), tp ranks holding no real column. tp 1 here; tp 2 and 4 in one spawn of 4
gloo ranks; torch.compile(aot_eager, fullgraph=True) equals eager at tp 1 and 2; the kernels
compile for sm_80 and sm_90 with Triton's real compiler (a subprocess, no GPU needed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import background
import pytest
import torch
import torch.nn.functional as F
from cases import CaseLog, assert_case
from kernel_checks import rel_err

from tpzoo.kernels import launch
from tpzoo.parallel import init_mesh, vocab_parallel_cross_entropy
from tpzoo.parallel.collectives import split
from tpzoo.kernels import cross_entropy

pytestmark = pytest.mark.tier("distributed")



CHUNK = 8
# name: (padded vocabulary V', real vocabulary V, label smoothing, ignore_index); V' divisible by 4 (tp)
CASES = {
    "plain": (20, 20, 0.0, -100),
    "smoothing": (36, 35, 0.1, -100),
    "ignore-in-vocab": (36, 35, 0.2, 3),
    "padded-vocab": (48, 37, 0.1, -100),
    "empty-ranks": (16, 5, 0.1, -100),  # tp 2: rank 1 holds padding only; tp 4: ranks 2 and 3
}
# float64 within 1e-6 (the bound); float32 1e-5; bf16 logits: the loss in float32, the
# gradient stored in bf16 (half an ulp of its largest entry)
TOLS = {torch.float64: (1e-6, 1e-6), torch.float32: (1e-5, 1e-5),
        torch.bfloat16: (1e-5, torch.finfo(torch.bfloat16).eps / 2 + 1e-5)}


def make_inputs(case: str, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [3, 6, V'] (padding columns 1e3: counted, they would dominate), targets [3, 6] (every
    other one of sequence 1 and all of sequence 2 ignored), loss gradient [3, 6]."""
    padded, vocab, _, ignore_index = CASES[case]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 6, padded, generator=g, dtype=torch.float64) * 3
    logits[..., vocab:] = 1e3
    target = torch.randint(0, vocab, (3, 6), generator=g)
    target[0, :2] = torch.tensor([vocab - 1, 0])
    target[1, ::2] = ignore_index
    target[2] = ignore_index
    return logits.to(dtype), target, torch.randn(3, 6, generator=g, dtype=torch.float64)


def reference(logits: torch.Tensor, target: torch.Tensor, dl: torch.Tensor, case: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """F.cross_entropy in float64 over the real columns: (loss [3, 6], grad [3, 6, V'], 0 on padding)."""
    padded, vocab, smoothing, ignore_index = CASES[case]
    z = logits[..., :vocab].double().requires_grad_()
    loss = F.cross_entropy(z.transpose(1, 2), target, reduction="none", ignore_index=ignore_index,
                           label_smoothing=smoothing)
    loss.backward(dl)
    return loss.detach(), F.pad(z.grad, (0, padded - vocab))


def fused(logits: torch.Tensor, target: torch.Tensor, dl: torch.Tensor, case: str, fn=cross_entropy, **kw
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, grad of the logits) of ``fn`` (the fused cross entropy, maybe compiled)."""
    _, vocab, smoothing, ignore_index = CASES[case]
    x = logits.detach().requires_grad_()
    loss = fn(x, target, smoothing, ignore_index, vocab_size=vocab, **kw)
    loss.backward(dl.to(loss.dtype))
    return loss.detach(), x.grad


def assert_matches(loss, grad, ref_loss, ref_grad, target, ignore_index, dtype) -> None:
    loss_tol, grad_tol = TOLS[dtype]
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert grad.dtype == dtype
    assert rel_err(loss, ref_loss) <= loss_tol, f"loss error {rel_err(loss, ref_loss):.3g}"
    assert rel_err(grad, ref_grad) <= grad_tol, f"gradient error {rel_err(grad, ref_grad):.3g}"
    ignored = target == ignore_index
    assert not loss[ignored].any() and not grad[ignored].any(), "ignored targets count"


@pytest.fixture(autouse=True)
def chunk(monkeypatch):
    monkeypatch.setattr(launch, "MAX_BLOCK", CHUNK)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_matches_float64(backend, case, dtype):
    logits, target, dl = make_inputs(case, dtype)
    ref_loss, ref_grad = reference(logits, target, dl, case)
    loss, grad = fused(logits, target, dl, case)
    assert_matches(loss, grad, ref_loss, ref_grad, target, CASES[case][3], dtype)
    assert not grad[..., CASES[case][1]:].any(), "padding columns got gradient"


@pytest.mark.tier("unit")
def test_cross_entropy_compiles_fullgraph(backend):
    logits, target, dl = make_inputs("padded-vocab", torch.float32)
    compiled = torch.compile(cross_entropy, backend="aot_eager", fullgraph=True)
    for got, want in zip(fused(logits, target, dl, "padded-vocab", compiled),
                         fused(logits, target, dl, "padded-vocab")):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def parallel_checks() -> CaseLog:
    """On each of 4 ranks: tp 2 and 4, both backends, every case in float64; compiled at tp 2."""
    log = CaseLog()
    launch.MAX_BLOCK = CHUNK
    launch.new_empty = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    for tp in (2, 4):
        group = init_mesh(tp=tp).tp_group
        for backend in ("triton", "torch"):
            for case in CASES:
                with log.case(f"tp{tp}-{backend}-{case}"):
                    logits, target, dl = make_inputs(case, torch.float64, seed=tp)
                    ref_loss, ref_grad = reference(logits, target, dl, case)
                    loss, grad = fused(split(logits, 2, group), target, dl, case, vocab_parallel_cross_entropy,
                                       tp_group=group, backend=backend)
                    assert_matches(loss, grad, ref_loss, split(ref_grad, 2, group), target, CASES[case][3],
                                   torch.float64)
            if tp == 2:
                with log.case(f"tp2-{backend}-compiled"):
                    logits, target, dl = make_inputs("empty-ranks", torch.float32)
                    local = split(logits, 2, group)
                    eager = vocab_parallel_cross_entropy
                    compiled = torch.compile(eager, backend="aot_eager", fullgraph=True)
                    for got, want in zip(fused(local, target, dl, "empty-ranks", compiled, tp_group=group,
                                               backend=backend),
                                         fused(local, target, dl, "empty-ranks", eager, tp_group=group,
                                               backend=backend)):
                        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    return log


PARALLEL = [f"tp{tp}-{b}-{c}" for tp in (2, 4) for b in ("triton", "torch") for c in CASES] + \
           [f"tp2-{b}-compiled" for b in ("triton", "torch")]


@background.fixture
def parallel_logs(tmp_path_factory):
    return background.spawn(parallel_checks, 4, timeout=900)


@pytest.mark.tier("journey")
@pytest.mark.parametrize("name", PARALLEL)
def test_vocab_parallel_cross_entropy(parallel_logs, name):
    assert_case(parallel_logs, name)


def compile_kernels(capability: int) -> list[str]:
    """Run the op with every kernel variant compiled (not launched) for sm_<capability>.

    Only in a process that imported aot_compile first (it sets TRITON_INTERPRET=0): see the test below.
    """
    from aot_compile import compiling_for

    with compiling_for(capability) as seen:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for smoothing in (0.0, 0.1):
                x = torch.randn(4, 40, dtype=dtype, requires_grad=True)
                cross_entropy(x, torch.arange(4), smoothing, vocab_size=37).sum().backward()
    return seen


@background.fixture
def compiled(tmp_path_factory) -> subprocess.CompletedProcess:
    here, env = Path(__file__).parent, background.environ()
    env.update(TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton")),  # a fresh cache: really compile
               PYTHONPATH=os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")]))
    code = ("import aot_compile, test_kernels_cross_entropy as t; "
            "print('\\n'.join(t.compile_kernels(80) + t.compile_kernels(90)))")
    return subprocess.run(background.niced([sys.executable, "-c", code]), env=env, capture_output=True, text=True,
                          timeout=900)


def test_kernels_compile_for_ampere_and_hopper(compiled):
    out = compiled
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    # per target: 3 dtypes x 2 smoothings, a stats and a grad kernel each
    for arch in ("sm_80", "sm_90"):
        kernels = sorted(line.split()[1] for line in lines if line.startswith(arch + " "))
        assert kernels == ["_ce_grad"] * 6 + ["_ce_stats"] * 6, (arch, lines)
