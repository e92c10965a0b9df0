"""Triton LayerNorm and RMSNorm over the last dim, one kernel pair for both.

Forward, per row of N elements (float32 statistics, saved for backward):
    LayerNorm: mean = sum(x) / N, rstd = 1 / sqrt(sum((x - mean)^2) / N + eps), y = (x - mean) * rstd * w + b
    RMSNorm:   rstd = 1 / sqrt(sum(x^2) / N + eps),                            y = x * rstd * w
Backward, with xhat = (x - mean) * rstd (LayerNorm; x * rstd for RMSNorm) and g = w * dy:
    dx = rstd * (g - xhat * mean(g * xhat) - mean(g))   (the mean(g) term for LayerNorm only)
    dw = sum_rows(dy * xhat), db = sum_rows(dy)
Each backward program owns a group of rows and sums dw, db over them into its own row of a
[groups, N] float32 buffer; a second reduction over groups gives dw, db (no atomics).
Rows longer than ``launch.MAX_BLOCK`` loop over blocks: the forward reads x for the mean, the
variance and the output; the backward first stores mean(g * xhat), mean(g) per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch


@triton.jit
def _centered(x_row, cols, n, mean):
    """x - mean at ``cols`` in float32, 0 past the row end."""
    x = tl.load(x_row + cols, mask=cols < n, other=0.0).to(tl.float32)
    return tl.where(cols < n, x - mean, 0.0)


@triton.jit
def _norm_fwd(
    X, W, B, Y, Mean, Rstd, n, s_x, s_y, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, LOOPED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * s_x
    y_row = Y + row * s_y
    cols = tl.arange(0, BLOCK)
    if LOOPED:
        mean = 0.0
        if not IS_RMS:
            acc = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n, BLOCK):
                acc += _centered(x_row, start + cols, n, 0.0)
            mean = tl.sum(acc, 0) / n
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            d = _centered(x_row, start + cols, n, mean)
            acc += d * d
        var = tl.sum(acc, 0) / n
    else:
        x = _centered(x_row, cols, n, 0.0)
        mean = 0.0
        if not IS_RMS:
            mean = tl.sum(x, 0) / n
        d = tl.where(cols < n, x - mean, 0.0)
        var = tl.sum(d * d, 0) / n
    rstd = 1.0 / tl.sqrt(var + eps)
    if not IS_RMS:
        tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)
    for start in range(0, n, BLOCK):  # a single pass when not LOOPED (BLOCK >= n)
        if LOOPED:
            d = _centered(x_row, start + cols, n, mean)
        keep = start + cols < n
        y = d * rstd * tl.load(W + start + cols, mask=keep, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(B + start + cols, mask=keep, other=0.0).to(tl.float32)
        launch.store(y_row + start + cols, y, keep)


@triton.jit
def _row_stats(Mean, Rstd, row, IS_RMS: tl.constexpr):
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(Mean + row)
    return mean, tl.load(Rstd + row)


@triton.jit
def _grad_terms(x_row, dy_row, w, cols, n, mean, rstd):
    """xhat, g = w * dy and dy at ``cols`` in float32, 0 past the row end."""
    xhat = _centered(x_row, cols, n, mean) * rstd
    dy = tl.load(dy_row + cols, mask=cols < n, other=0.0).to(tl.float32)
    return xhat, w * dy, dy


@triton.jit
def _norm_bwd(
    X, W, DY, DX, Mean, Rstd, Proj, DWp, DBp, rows, n, s_x, s_dy, s_dx, rows_per_group,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, LOOPED: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    first = group * rows_per_group
    last = tl.minimum(first + rows_per_group, rows)
    cols = tl.arange(0, BLOCK)
    if LOOPED:  # dx needs mean(g * xhat) and mean(g) over the whole row: store them per row first
        for row in range(first, last):
            mean, rstd = _row_stats(Mean, Rstd, row, IS_RMS)
            acc_gx = tl.zeros([BLOCK], tl.float32)
            acc_g = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n, BLOCK):
                w = tl.load(W + start + cols, mask=start + cols < n, other=0.0).to(tl.float32)
                xhat, g, dy = _grad_terms(X + row * s_x, DY + row * s_dy, w, start + cols, n, mean, rstd)
                acc_gx += g * xhat
                acc_g += g
            tl.store(Proj + 2 * row, tl.sum(acc_gx, 0) / n)
            tl.store(Proj + 2 * row + 1, tl.sum(acc_g, 0) / n)
    for start in range(0, n, BLOCK):  # a single pass when not LOOPED (BLOCK >= n)
        keep = start + cols < n
        w = tl.load(W + start + cols, mask=keep, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], tl.float32)
        db = tl.zeros([BLOCK], tl.float32)
        for row in range(first, last):
            mean, rstd = _row_stats(Mean, Rstd, row, IS_RMS)
            xhat, g, dy = _grad_terms(X + row * s_x, DY + row * s_dy, w, start + cols, n, mean, rstd)
            if LOOPED:
                mean_gx = tl.load(Proj + 2 * row)
                mean_g = tl.load(Proj + 2 * row + 1)
            else:
                mean_gx = tl.sum(g * xhat, 0) / n
                mean_g = tl.sum(g, 0) / n
            dx = g - xhat * mean_gx
            if not IS_RMS:
                dx -= mean_g
            launch.store(DX + row * s_dx + start + cols, dx * rstd, keep)
            dw += dy * xhat
            db += dy
        tl.store(DWp + group * n + start + cols, dw, mask=keep)
        if HAS_BIAS:
            tl.store(DBp + group * n + start + cols, db, mask=keep)


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
            is_rms: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, mean, rstd): y of x's shape and dtype (contiguous), float32 mean and rstd of shape x.shape[:-1].

    RMSNorm (is_rms) has no mean: None.
    """
    x2 = launch.as_rows(x)
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    rows, n = x2.shape
    y = launch.new_empty((rows, n), x.dtype, x.device)
    rstd = launch.new_empty((rows,), torch.float32, x.device)
    mean = None if is_rms else launch.new_empty((rows,), torch.float32, x.device)
    block, looped = launch.row_block(n)
    _norm_fwd[(rows,)](
        x2, weight, weight if bias is None else bias, y, rstd if mean is None else mean, rstd, n,
        x2.stride(0), y.stride(0), eps,
        IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK=block, LOOPED=looped, num_warps=launch.num_warps(block),
    )
    stats = x.shape[:-1]
    return y.view(x.shape), None if mean is None else mean.view(stats), rstd.view(stats)


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             mean: torch.Tensor | None, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx, dweight, dbias) from the forward's inputs and float32 statistics (mean None: RMSNorm).

    dx has x's shape and dtype (contiguous); dweight (dbias) weight's (bias's) dtype; dbias None without bias.
    """
    x2 = launch.as_rows(x)
    dy2 = launch.as_rows(dy)
    weight = weight.contiguous()
    rows, n = x2.shape
    dx = launch.new_empty((rows, n), x.dtype, x.device)
    groups, rows_per_group = launch.partial_groups(x.device, rows)
    dw_part = launch.new_empty((groups, n), torch.float32, x.device)
    db_part = dw_part if bias is None else launch.new_empty((groups, n), torch.float32, x.device)
    block, looped = launch.row_block(n)
    proj = launch.new_empty((rows, 2), torch.float32, x.device) if looped else rstd  # unused unless looped
    _norm_bwd[(groups,)](
        x2, weight, dy2, dx, rstd if mean is None else mean, rstd, proj, dw_part, db_part, rows, n,
        x2.stride(0), dy2.stride(0), dx.stride(0), rows_per_group,
        IS_RMS=mean is None, HAS_BIAS=bias is not None, BLOCK=block, LOOPED=looped,
        num_warps=launch.num_warps(block),
    )
    db = None if bias is None else db_part.sum(0).to(bias.dtype)
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype), db
