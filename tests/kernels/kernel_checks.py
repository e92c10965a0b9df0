"""Helpers for the kernel tests: error measures, the accuracy check, odd memory layouts.

``check`` runs an op (under the backend the ``backend`` fixture chose) and an independent
float64 oracle on the same inputs, forward and backward, and for bf16/fp16 also PyTorch's own
ops in that dtype as the error baseline. An error is max |out - ref| / max |ref| over a whole
output or gradient, in float64.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
F32_RTOL = 1e-5  # float32: bound on every relative error

# Largest error seen per (op, backend, dtype, "y" | "dx" | "dparams"), printed after the run.
OBSERVED: dict[tuple[str, str, str, str], float] = {}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in float64; a NaN or inf in out is an infinite error."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def transposed_layout(t: torch.Tensor) -> torch.Tensor:
    """The same values with the first and last dims swapped in memory (last-dim stride != 1)."""
    return t.transpose(0, -1).contiguous().transpose(0, -1)


def padded_rows(t: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """The same values as a view whose rows are ``pad`` elements apart beyond their length."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


def _run(fn: Callable, inputs: list, dy: torch.Tensor) -> list[torch.Tensor]:
    """[y, grads of the float inputs] of fn(*inputs) for output gradient dy."""
    leaves = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
              for t in inputs]
    y = fn(*leaves)
    wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    return [y.detach(), *torch.autograd.grad(y, wrt, dy.to(y.dtype))]


def _double(inputs: list) -> list:
    return [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]


def check(label: str, op: Callable, oracle: Callable, native: Callable, inputs: list,
          dy_layout: Callable = lambda t: t) -> dict[str, float]:
    """Assert op's output and input gradients match oracle (float64) and return the errors.

    The dtype is that of inputs[0]. float32: each error <= F32_RTOL. bf16/fp16: each error <=
    2 * the error of ``native`` (PyTorch's own ops in that dtype) + LOWP_ATOL. The output
    gradient is random, laid out by ``dy_layout``. The errors are recorded under ``label``.
    """
    dtype = inputs[0].dtype
    ref_y = oracle(*_double(inputs))
    dy = dy_layout(torch.randn(ref_y.shape, dtype=torch.float64).to(dtype))
    got = _run(op, inputs, dy)
    ref = _run(oracle, _double(inputs), dy.double())
    names = ["y"] + [f"d{i}" for i in range(len(ref) - 1)]  # d0: the gradient of inputs[0], ...
    errors = {n: rel_err(g, r) for n, g, r in zip(names, got, ref)}
    for name, err in errors.items():
        kind = {"y": "y", "d0": "dx"}.get(name, "dparams")
        key = (label, os.environ["TPZOO_KERNELS"], str(dtype).removeprefix("torch."), kind)
        OBSERVED[key] = max(OBSERVED.get(key, 0.0), err)
    native_errors = [rel_err(b, r) for b, r in zip(_run(native, inputs, dy), ref)]
    if dtype == torch.float32:  # 1e-5, or twice PyTorch's own float32 error where that is larger (GELU's erf
        # form on inputs all far below 0, whose outputs are all near 0, cancels in float32: seen once, 4x1 input)
        bounds = {n: max(F32_RTOL, 2 * e) for n, e in zip(names, native_errors)}
    else:  # the slack: half a unit in the last place of the dtype, the error of rounding max |ref| once
        slack = torch.finfo(dtype).eps / 2
        bounds = {n: 2 * e + slack for n, e in zip(names, native_errors)}
    bad = {n: f"{errors[n]:.3g} > {bounds[n]:.3g}" for n in names if not errors[n] <= bounds[n]}
    assert not bad, f"{dtype} errors above their bounds: {bad}"
    return errors
