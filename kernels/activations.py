"""Triton GELU and bias + GELU, exact (erf, BERT) and tanh (GPT-2) forms.

With z = x (+ bias broadcast over the last dim):
    exact: y = z * Phi(z),        Phi(z) = (1 + erf(z / sqrt 2)) / 2,  y' = Phi(z) + z * exp(-z^2 / 2) / sqrt(2 pi)
    tanh:  y = z * s,             s = sigmoid(2u) = (1 + tanh u) / 2,  u = sqrt(2 / pi) * (z + 0.044715 z^3)
                                  y' = s + z * s * (1 - s) * 2 sqrt(2 / pi) * (1 + 3 * 0.044715 z^2)
Backward recomputes z from the saved inputs: dx = dy * y'. For bias + GELU each program owns a
column block of a group of rows and sums dx over its rows into its own row of a [groups, N]
float32 buffer (the bias gradient is reduced in the same pass, no atomics); a second reduction
over groups gives dbias. One kernel serves both passes: tiles [BLOCK_M, BLOCK_N] of x viewed as
[rows, N] (plain GELU: a single row of all elements), 64-bit offsets throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch

# Constants stay on the right of tensors: constexpr * tensor fails under Triton's interpreter.
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_TWO_SQRT_2_OVER_PI = tl.constexpr(1.5957691216057308)
_COEF = tl.constexpr(0.044715)
_COEF3 = tl.constexpr(0.134145)  # 3 * 0.044715


@triton.jit
def _gelu_value_grad(z, TANH: tl.constexpr, BACKWARD: tl.constexpr):
    """GELU(z) in the forward pass, GELU'(z) in the backward pass (float32)."""
    if TANH:
        # sigmoid(2u) written out (tl.sigmoid fails under Triton's interpreter); the exponent is
        # capped below float32 overflow, where s < 1e-34 anyway
        s = 1.0 / (1.0 + tl.exp(tl.minimum(-((z + z * z * z * _COEF) * _TWO_SQRT_2_OVER_PI), 80.0)))
        if BACKWARD:
            out = s + z * s * (1.0 - s) * (1.0 + z * z * _COEF3) * _TWO_SQRT_2_OVER_PI
        else:
            out = z * s
    else:
        cdf = 0.5 * (1.0 + tl.erf(z * _SQRT1_2))
        if BACKWARD:
            out = cdf + z * tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
        else:
            out = z * cdf
    return out


@triton.jit
def _gelu_kernel(
    X, B, DY, OUT, DBp, rows, n, rows_per_group, col_blocks,
    HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """OUT = GELU(x + b), or in the backward pass OUT = dy * GELU'(x + b) and DBp[group] = sum_rows OUT."""
    pid = tl.program_id(0).to(tl.int64)
    group = pid // col_blocks
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = group * rows_per_group
    for start in range(first, tl.minimum(first + rows_per_group, rows), BLOCK_M):
        r = start + tl.arange(0, BLOCK_M)
        keep = (r < rows)[:, None] & col_ok[None, :]
        offs = r[:, None] * n + cols[None, :]
        z = tl.load(X + offs, mask=keep, other=0.0).to(tl.float32) + bias[None, :]
        out = _gelu_value_grad(z, TANH, BACKWARD)
        if BACKWARD:
            out *= tl.load(DY + offs, mask=keep, other=0.0).to(tl.float32)  # 0 outside the tensor
            db += out
        launch.store(OUT + offs, out, keep)
    if BACKWARD and HAS_BIAS:
        tl.store(DBp + group * n + cols, tl.sum(db, 0), mask=col_ok)


def _launch(
    x: torch.Tensor, bias: torch.Tensor | None, dy: torch.Tensor | None, tanh: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the kernel on contiguous x viewed as [rows, n]; returns (out, dbias partials or None)."""
    rows, n = (x.numel() // x.shape[-1], x.shape[-1]) if bias is not None else (1, x.numel())
    block_m, block_n = launch.tile(rows, n)
    backward = dy is not None
    if backward and bias is not None:
        groups, rows_per_group = launch.partial_groups(x.device, rows, multiple=block_m)
    else:  # one tile of rows per program
        groups, rows_per_group = triton.cdiv(rows, block_m), block_m
    col_blocks = triton.cdiv(n, block_n)
    out = launch.new_empty(x.shape, x.dtype, x.device)
    db_part = launch.new_empty((groups, n), torch.float32, x.device) if backward and bias is not None else None
    _gelu_kernel[(groups * col_blocks,)](
        x, x if bias is None else bias, x if dy is None else dy, out, out if db_part is None else db_part,
        rows, n, rows_per_group, col_blocks,
        HAS_BIAS=bias is not None, TANH=tanh, BACKWARD=backward, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=launch.num_warps(block_m * block_n),
    )
    return out, db_part


def forward(x: torch.Tensor, bias: torch.Tensor | None, tanh: bool) -> torch.Tensor:
    """GELU(x + bias) (bias [x.shape[-1]] or None), a new contiguous tensor of x's shape and dtype."""
    return _launch(x.contiguous(), None if bias is None else bias.contiguous(), None, tanh)[0]


def backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
             tanh: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dbias): dx = dy * GELU'(x + bias) (x's dtype, contiguous), dbias = sum_rows dx (None without bias)."""
    dx, db_part = _launch(x.contiguous(), None if bias is None else bias.contiguous(), dy.contiguous(), tanh)
    return dx, None if bias is None else db_part.sum(0).to(bias.dtype)
