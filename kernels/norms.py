"""Triton LayerNorm and RMSNorm over the last dim, one kernel pair for both.

Forward, per row of N elements (float32 statistics, saved for backward):
    LayerNorm: mean = sum(x) / N, rstd = 1 / sqrt(sum((x - mean)^2) / N + eps), y = (x - mean) * rstd * w + b
    RMSNorm:   rstd = 1 / sqrt(sum(x^2) / N + eps),                            y = x * rstd * w
Backward, with xhat = (x - mean) * rstd (LayerNorm; x * rstd for RMSNorm) and g = w * dy:
    dx = rstd * (g - xhat * mean(g * xhat) - mean(g))   (the mean(g) term for LayerNorm only)
    dw = sum_rows(dy * xhat), db = sum_rows(dy)
Both kernels work on tiles of ROWS rows x BLOCK columns (``launch.row_tile``): several short rows
per tile (ROWS x BLOCK up to ``launch.MAX_TILE`` elements), so that each step of a program
moves a few KB. The forward runs one tile per program. Each backward program owns a group of
rows, walks it tile by tile and accumulates dy * xhat and dy in [ROWS, BLOCK] float32
registers, summed once at the end into its own row of a [groups, N] float32 buffer; a second
reduction over groups gives dw, db (no atomics). Rows longer than ``launch.MAX_BLOCK`` (one row
per tile) loop over column blocks: the forward reads x for the mean, the variance and the
output; the backward first stores mean(g * xhat), mean(g) per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch


@triton.jit
def _centered(X, row_offs, row_ok, cols, n, mean):
    """x - mean on the tile [rows, cols] in float32 (mean: [ROWS, 1] or 0), 0 outside the tensor."""
    keep = row_ok[:, None] & (cols < n)[None, :]
    x = tl.load(X + row_offs[:, None] + cols[None, :], mask=keep, other=0.0).to(tl.float32)
    return tl.where(keep, x - mean, 0.0)


@triton.jit
def _norm_fwd(
    X, W, B, Y, Mean, Rstd, rows, n, s_x, s_y, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOOPED: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    cols = tl.arange(0, BLOCK)
    mean = tl.zeros([ROWS], tl.float32)
    if LOOPED:
        if not IS_RMS:
            acc = tl.zeros([ROWS, BLOCK], tl.float32)
            for start in range(0, n, BLOCK):
                acc += _centered(X, r * s_x, row_ok, start + cols, n, 0.0)
            mean = tl.sum(acc, 1) / n
        acc = tl.zeros([ROWS, BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            d = _centered(X, r * s_x, row_ok, start + cols, n, mean[:, None])
            acc += d * d
        var = tl.sum(acc, 1) / n
    else:
        x = _centered(X, r * s_x, row_ok, cols, n, 0.0)
        if not IS_RMS:
            mean = tl.sum(x, 1) / n
        d = tl.where(row_ok[:, None] & (cols < n)[None, :], x - mean[:, None], 0.0)
        var = tl.sum(d * d, 1) / n
    rstd = 1.0 / tl.sqrt(var + eps)
    if not IS_RMS:
        tl.store(Mean + r, mean, mask=row_ok)
    tl.store(Rstd + r, rstd, mask=row_ok)
    for start in range(0, n, BLOCK):  # a single pass when not LOOPED (BLOCK >= n)
        if LOOPED:
            d = _centered(X, r * s_x, row_ok, start + cols, n, mean[:, None])
        keep = start + cols < n
        y = d * rstd[:, None] * tl.load(W + start + cols, mask=keep, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y += tl.load(B + start + cols, mask=keep, other=0.0).to(tl.float32)[None, :]
        launch.store(Y + (r * s_y)[:, None] + (start + cols)[None, :], y, row_ok[:, None] & keep[None, :])


@triton.jit
def _grad_terms(X, DY, r, row_ok, s_x, s_dy, Mean, Rstd, w, cols, n,
                IS_RMS: tl.constexpr, ROWS: tl.constexpr):
    """rstd [ROWS] and xhat, g = w * dy, dy on the tile [r, cols] in float32, 0 outside the tensor."""
    rstd = tl.load(Rstd + r, mask=row_ok, other=0.0)
    mean = tl.zeros([ROWS], tl.float32)
    if not IS_RMS:
        mean = tl.load(Mean + r, mask=row_ok, other=0.0)
    xhat = _centered(X, r * s_x, row_ok, cols, n, mean[:, None]) * rstd[:, None]
    keep = row_ok[:, None] & (cols < n)[None, :]
    dy = tl.load(DY + (r * s_dy)[:, None] + cols[None, :], mask=keep, other=0.0).to(tl.float32)
    return rstd, xhat, w[None, :] * dy, dy


@triton.jit
def _norm_bwd(
    X, W, DY, DX, Mean, Rstd, Proj, DWp, DBp, rows, n, s_x, s_dy, s_dx, rows_per_group,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOOPED: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    first = group * rows_per_group
    last = tl.minimum(first + rows_per_group, rows)
    cols = tl.arange(0, BLOCK)
    tile = tl.arange(0, ROWS)
    if LOOPED:  # dx needs mean(g * xhat) and mean(g) over the whole row: store them per row first
        for start in range(first, last, ROWS):
            r = start + tile
            acc_gx = tl.zeros([ROWS, BLOCK], tl.float32)
            acc_g = tl.zeros([ROWS, BLOCK], tl.float32)
            for c in range(0, n, BLOCK):
                w = tl.load(W + c + cols, mask=c + cols < n, other=0.0).to(tl.float32)
                _, xhat, g, _ = _grad_terms(X, DY, r, r < last, s_x, s_dy, Mean, Rstd, w, c + cols, n,
                                            IS_RMS, ROWS)
                acc_gx += g * xhat
                acc_g += g
            tl.store(Proj + 2 * r, tl.sum(acc_gx, 1) / n, mask=r < last)
            tl.store(Proj + 2 * r + 1, tl.sum(acc_g, 1) / n, mask=r < last)
    for c in range(0, n, BLOCK):  # a single pass when not LOOPED (BLOCK >= n)
        keep = c + cols < n
        w = tl.load(W + c + cols, mask=keep, other=0.0).to(tl.float32)
        dw = tl.zeros([ROWS, BLOCK], tl.float32)
        db = tl.zeros([ROWS, BLOCK], tl.float32)
        for start in range(first, last, ROWS):
            r = start + tile
            row_ok = r < last
            rstd, xhat, g, dy = _grad_terms(X, DY, r, row_ok, s_x, s_dy, Mean, Rstd, w, c + cols, n,
                                            IS_RMS, ROWS)
            if LOOPED:
                mean_gx = tl.load(Proj + 2 * r, mask=row_ok, other=0.0)
                mean_g = tl.load(Proj + 2 * r + 1, mask=row_ok, other=0.0)
            else:
                mean_gx = tl.sum(g * xhat, 1) / n
                mean_g = tl.sum(g, 1) / n
            dx = g - xhat * mean_gx[:, None]
            if not IS_RMS:
                dx -= mean_g[:, None]
            launch.store(DX + (r * s_dx)[:, None] + (c + cols)[None, :], dx * rstd[:, None],
                         row_ok[:, None] & keep[None, :])
            dw += dy * xhat
            db += dy
        tl.store(DWp + group * n + c + cols, tl.sum(dw, 0), mask=keep)
        if HAS_BIAS:
            tl.store(DBp + group * n + c + cols, tl.sum(db, 0), mask=keep)


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
    tile_rows, block, looped = launch.row_tile(rows, n)
    _norm_fwd[(triton.cdiv(rows, tile_rows),)](
        x2, weight, weight if bias is None else bias, y, rstd if mean is None else mean, rstd, rows, n,
        x2.stride(0), y.stride(0), eps, IS_RMS=is_rms, HAS_BIAS=bias is not None, ROWS=tile_rows, BLOCK=block,
        LOOPED=looped, num_warps=launch.num_warps(tile_rows * block),
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
    tile_rows, block, looped = launch.row_tile(rows, n)
    groups, rows_per_group = launch.partial_groups(x.device, rows, multiple=tile_rows)
    dw_part = launch.new_empty((groups, n), torch.float32, x.device)
    db_part = dw_part if bias is None else launch.new_empty((groups, n), torch.float32, x.device)
    proj = launch.new_empty((rows, 2), torch.float32, x.device) if looped else rstd  # unused unless looped
    _norm_bwd[(groups,)](
        x2, weight, dy2, dx, rstd if mean is None else mean, rstd, proj, dw_part, db_part, rows, n,
        x2.stride(0), dy2.stride(0), dx.stride(0), rows_per_group,
        IS_RMS=mean is None, HAS_BIAS=bias is not None, ROWS=tile_rows, BLOCK=block, LOOPED=looped,
        num_warps=launch.num_warps(tile_rows * block),
    )
    db = None if bias is None else db_part.sum(0).to(bias.dtype)
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype), db
