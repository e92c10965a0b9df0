"""Triton passes of the fused (vocab-parallel) cross entropy.

A rank holds logits z [rows, part] of which columns 0 .. n_real-1 are real vocabulary entries
(global ids start .. start+n_real-1) and the rest padding. One program per row walks the row in
chunks of ``launch.MAX_BLOCK`` columns, in float32 (float64 for float64 logits):

  stats (pass 1): online m = max_j z_j and s = sum_j exp(z_j - m) over the real columns, the
                  target's logit z_t where t is this rank's (else 0), and sum_j z_j (smoothing).
  grad  (pass 2): from the global log-sum-exp L: g_j = exp(z_j - L) - (1 - e) [j = t] - e / V,
                  0 on padding columns and on rows whose target is ignore_index; in z's dtype.

Neither pass holds more than one chunk of a row; no float32 [rows, part] copy exists. The
all-reduces between the passes, and the ``tpzoo::cross_entropy_*`` operators around ``stats`` and
``grad``, are tpzoo/parallel/cross_entropy.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch


@triton.jit
def _ce_stats(Z, T, M, S, rows, stride, start, n_real, ignore_index, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride
    acc: tl.constexpr = tl.float64 if Z.dtype.element_ty == tl.float64 else tl.float32  # the math dtype
    cols = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), acc)
    s = tl.zeros([], acc)
    total = tl.zeros([], acc)
    for off in range(0, n_real, BLOCK):
        keep = off + cols < n_real
        z = tl.load(z_row + off + cols, mask=keep, other=float("-inf")).to(acc)
        new_m = tl.maximum(m, tl.max(z, 0))
        shift = tl.where(new_m == float("-inf"), 0.0, new_m).to(acc)  # -inf only while nothing was read
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), 0)
        m = new_m
        if SMOOTH:
            total += tl.sum(tl.where(keep, z, 0.0), 0)
    target = tl.load(T + row)
    t = target - start
    here = (target != ignore_index) & (t >= 0) & (t < n_real)
    z_t = tl.load(z_row + tl.where(here, t, 0), mask=here, other=0.0).to(acc)
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(S + rows + row, z_t)
    tl.store(S + 2 * rows + row, total)


@triton.jit
def _ce_grad(Z, T, LSE, G, stride, part, start, n_real, ignore_index, smoothing, vocab_size,
             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride
    g_row = G + row * part
    acc: tl.constexpr = tl.float64 if Z.dtype.element_ty == tl.float64 else tl.float32  # the math dtype
    target = tl.load(T + row)
    n_read = tl.where(target != ignore_index, n_real, 0)  # an ignored row reads nothing and gets 0
    t = target - start
    lse = tl.load(LSE + row)
    eps = smoothing + tl.zeros([], acc)  # a float argument is float32: the math runs in acc
    uniform = eps / vocab_size
    cols = tl.arange(0, BLOCK)
    for off in range(0, part, BLOCK):
        c = off + cols
        real = c < n_read
        z = tl.load(z_row + c, mask=real, other=float("-inf")).to(acc)
        g = tl.exp(z - lse) - tl.where(c == t, 1.0 - eps, 0.0) - uniform
        launch.store(g_row + c, tl.where(real, g, 0.0), c < part)


def _check_rows(logits: torch.Tensor, target: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1 or target.shape != logits.shape[:1] or not target.is_contiguous():
        raise ValueError(f"expected logits [rows, part] with unit last stride and contiguous target [rows], got "
                         f"{tuple(logits.shape)} (strides {logits.stride()}) and {tuple(target.shape)}")


def acc_dtype(logits: torch.Tensor) -> torch.dtype:
    """The dtype of the statistics and the math: float64 for float64 logits, else float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _block(n: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), launch.MAX_BLOCK)


def stats(logits: torch.Tensor, target: torch.Tensor, start: int, n_real: int, ignore_index: int,
          smoothing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1. logits [rows, part], target [rows] global ids -> (m [rows], [s, z_t, sum_z] [3, rows]).

    Over the real columns 0 .. n_real-1 (global ids start ..): m = max z (-inf if none), s =
    sum exp(z - m), z_t the target's logit where it is this rank's and not ignored (else 0),
    sum_z = sum z (0 unless ``smoothing``); in ``acc_dtype``.
    """
    _check_rows(logits, target)
    rows = logits.shape[0]
    m = launch.new_empty((rows,), acc_dtype(logits), logits.device)
    s = launch.new_empty((3, rows), acc_dtype(logits), logits.device)
    if rows:
        block = _block(n_real)
        _ce_stats[(rows,)](logits, target, m, s, rows, logits.stride(0), start, n_real, ignore_index,
                           SMOOTH=smoothing, BLOCK=block, num_warps=launch.num_warps(block))
    return m, s


def grad(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, start: int, n_real: int,
         ignore_index: int, smoothing: float, vocab_size: int) -> torch.Tensor:
    """Pass 2. d loss / d logits [rows, part] in logits' dtype, from the global log-sum-exp ``lse`` [rows]:
    exp(z_j - lse) - (1 - smoothing) [j = t] - smoothing / vocab_size on real columns of counted rows, else 0."""
    _check_rows(logits, target)
    rows, part = logits.shape
    g = launch.new_empty((rows, part), logits.dtype, logits.device)
    if rows:
        block = _block(part)
        _ce_grad[(rows,)](logits, target, lse.contiguous(), g, logits.stride(0), part, start, n_real, ignore_index,
                          float(smoothing), vocab_size, BLOCK=block, num_warps=launch.num_warps(block))
    return g
