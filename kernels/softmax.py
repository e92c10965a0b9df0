"""Triton scaled softmax over the last dim of [batch, heads, sq, sk] scores: masked and causal.

Forward: y = softmax(scale * x) over keys that are not masked; a row with every key masked
gives zeros. Each program owns a tile of ROWS rows x BLOCK keys (``launch.row_tile``): several
short rows (ROWS x BLOCK up to ``launch.MAX_TILE`` elements), read once and written once; a row
longer than ``launch.MAX_BLOCK`` keys (one per program) first finds its max and normaliser
online (one read), then writes.
The causal kernel never reads keys above the diagonal. Backward from the saved output:
dx = scale * y * (dy - sum(dy * y)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch


@triton.jit
def _row_offset(row, heads, sq, s_b, s_h, s_q):
    """Offset of the start of row ``row`` (= (b * heads + h) * sq + q) of a 4-D strided tensor."""
    q = row % sq
    bh = row // sq
    return (bh // heads) * s_b + (bh % heads) * s_h + q * s_q


@triton.jit
def _visible_keys(r, row_ok, sq, sk, CAUSAL: tl.constexpr):
    """[ROWS] int32: keys 0 .. n-1 of each row may be visible (0 past the last row); causal rows see
    k <= q + sk - sq."""
    n = tl.where(row_ok, sk, 0)
    if CAUSAL:
        n = tl.minimum((r % sq).to(tl.int32) + (sk - sq) + 1, n)
    return n


@triton.jit
def _load_scores(x_rows, m_rows, s_mk, cols, n_visible, scale, HAS_MASK: tl.constexpr):
    """scale * x on the tile [rows, cols] in float32, -inf where masked out; masked keys are not read."""
    keep = cols[None, :] < n_visible[:, None]
    if HAS_MASK:
        keep = keep & (tl.load(m_rows[:, None] + cols[None, :] * s_mk, mask=keep, other=1) == 0)
    x = tl.load(x_rows[:, None] + cols[None, :], mask=keep, other=0.0).to(tl.float32)
    return tl.where(keep, x * scale, float("-inf"))


@triton.jit
def _softmax_fwd(
    X, M, Y, rows, heads, sq, sk,
    s_xb, s_xh, s_xq, s_mb, s_mh, s_mq, s_mk, scale,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOOPED: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    x_rows = X + _row_offset(r, heads, sq, s_xb, s_xh, s_xq)
    m_rows = M + _row_offset(r, heads, sq, s_mb, s_mh, s_mq)
    n_visible = _visible_keys(r, row_ok, sq, sk, CAUSAL)
    cols = tl.arange(0, BLOCK)
    if LOOPED:
        # Online max and normaliser; the shift stays 0 while every key so far is masked.
        mx = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        for start in range(0, tl.max(n_visible, 0), BLOCK):
            s = _load_scores(x_rows, m_rows, s_mk, start + cols, n_visible, scale, HAS_MASK)
            new_mx = tl.maximum(mx, tl.max(s, 1))
            shift = tl.where(new_mx == float("-inf"), 0.0, new_mx)
            total = total * tl.exp(mx - shift) + tl.sum(tl.exp(s - shift[:, None]), 1)
            mx = new_mx
    else:
        s = _load_scores(x_rows, m_rows, s_mk, cols, n_visible, scale, HAS_MASK)
        mx = tl.max(s, 1)
        total = tl.sum(tl.exp(s - tl.where(mx == float("-inf"), 0.0, mx)[:, None]), 1)
    shift = tl.where(mx == float("-inf"), 0.0, mx)
    # total >= 1 unless every key is masked (then every exp is 0 and the row stays 0).
    inv = 1.0 / tl.maximum(total, 1.0)
    for start in range(0, sk, BLOCK):  # a single pass when not LOOPED (BLOCK >= sk)
        if LOOPED:
            s = _load_scores(x_rows, m_rows, s_mk, start + cols, n_visible, scale, HAS_MASK)
        y = tl.exp(s - shift[:, None]) * inv[:, None]
        keep = row_ok[:, None] & (start + cols < sk)[None, :]
        launch.store(Y + (r * sk)[:, None] + (start + cols)[None, :], y, keep)


@triton.jit
def _load_grad_pair(y_rows, dy_rows, cols, n_visible):
    """y and dy on the tile [rows, cols] in float32; keys past n_visible (y = 0 there) are not read."""
    keep = cols[None, :] < n_visible[:, None]
    y = tl.load(y_rows[:, None] + cols[None, :], mask=keep, other=0.0).to(tl.float32)
    dy = tl.load(dy_rows[:, None] + cols[None, :], mask=keep, other=0.0).to(tl.float32)
    return y, dy


@triton.jit
def _softmax_bwd(
    Y, DY, DX, rows, heads, sq, sk, s_db, s_dh, s_dq, scale,
    CAUSAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOOPED: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    y_rows = Y + r * sk
    dy_rows = DY + _row_offset(r, heads, sq, s_db, s_dh, s_dq)
    n_visible = _visible_keys(r, row_ok, sq, sk, CAUSAL)
    cols = tl.arange(0, BLOCK)
    if LOOPED:
        acc = tl.zeros([ROWS, BLOCK], tl.float32)
        for start in range(0, tl.max(n_visible, 0), BLOCK):
            y, dy = _load_grad_pair(y_rows, dy_rows, start + cols, n_visible)
            acc += y * dy
        dot = tl.sum(acc, 1)
    else:
        y, dy = _load_grad_pair(y_rows, dy_rows, cols, n_visible)
        dot = tl.sum(y * dy, 1)
    for start in range(0, sk, BLOCK):  # a single pass when not LOOPED (BLOCK >= sk)
        if LOOPED:
            y, dy = _load_grad_pair(y_rows, dy_rows, start + cols, n_visible)
        dx = scale * y * (dy - dot[:, None])
        keep = row_ok[:, None] & (start + cols < sk)[None, :]
        launch.store(DX + (r * sk)[:, None] + (start + cols)[None, :], dx, keep)


def forward(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    """y = softmax(scale * x) over the last dim of a 4-D x; ``mask`` (bool, True = masked) broadcasts to x.

    y is a new contiguous tensor of x's shape and dtype.
    """
    batch, heads, sq, sk = x.shape
    x = launch.unit_last_stride(x)
    y = launch.new_empty(x.shape, x.dtype, x.device)
    m = mask.expand(x.shape) if mask is not None else y  # y: a placeholder pointer, never read
    rows = batch * heads * sq
    tile_rows, block, looped = launch.row_tile(rows, sk)
    _softmax_fwd[(triton.cdiv(rows, tile_rows),)](
        x, m, y, rows, heads, sq, sk, x.stride(0), x.stride(1), x.stride(2),
        m.stride(0), m.stride(1), m.stride(2), m.stride(3), scale,
        HAS_MASK=mask is not None, CAUSAL=causal, ROWS=tile_rows, BLOCK=block, LOOPED=looped,
        num_warps=launch.num_warps(tile_rows * block),
    )
    return y


def backward(y: torch.Tensor, dy: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)) from the forward's output y (contiguous) and dy (any strides)."""
    batch, heads, sq, sk = y.shape
    dy = launch.unit_last_stride(dy)
    dx = launch.new_empty(y.shape, y.dtype, y.device)
    rows = batch * heads * sq
    tile_rows, block, looped = launch.row_tile(rows, sk)
    _softmax_bwd[(triton.cdiv(rows, tile_rows),)](
        y, dy, dx, rows, heads, sq, sk, dy.stride(0), dy.stride(1), dy.stride(2), scale,
        CAUSAL=causal, ROWS=tile_rows, BLOCK=block, LOOPED=looped, num_warps=launch.num_warps(tile_rows * block),
    )
    return dx
