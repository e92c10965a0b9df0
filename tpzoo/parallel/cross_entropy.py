"""Cross entropy over a vocabulary split across tp ranks, without gathering the logits.

Rank r holds logits z[..., r V'/tp : (r+1) V'/tp] of a vocabulary padded to V' >= V. Two passes
over the rank's slice, with O(tokens) numbers all-reduced between them:

  pass 1, per row, over the rank's real columns: m_r = max_j z_j, s_r = sum_j exp(z_j - m_r),
          the target's logit z_t (0 off its rank) and sum_j z_j (label smoothing only);
  then    M = max_r m_r (all-reduce MAX) and ONE all-reduce SUM of [s_r exp(m_r - M), z_t, sum z],
          so L = M + log sum_r s_r exp(m_r - M) = log sum_j exp(z_j) over the V real entries;
  loss  = L - z_t;  with label smoothing e:  (1 - e)(L - z_t) + e (L - sum_j z_j / V);
  pass 2  writes d loss / d z_j = exp(z_j - L) - (1 - e) [j = t] - e / V into a buffer of the
          logits' dtype, 0 on padding columns and ignored rows; backward scales it by the loss
          gradient (in place: the graph cannot be run backward twice).

The Triton backend (kernels/cross_entropy.py, as the tpzoo::cross_entropy_{stats,grad} operators)
runs each pass as one kernel chunked over the vocabulary: no float32 [tokens, V'/tp] tensor exists,
only the gradient in the logits' dtype. The torch backend (CPU by default) keeps one float32
[tokens, V'/tp] buffer, exp(z - m_r), that pass 2 rescales into the gradient in place (ignored rows
are zeroed in backward, and a bf16 gradient made there). Targets outside [0, V) that are not
ignore_index fail a device-side assertion: no host-device sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tpzoo.kernels.dispatch import kernel_module, use_triton
from tpzoo.parallel.collectives import resolve_tp_group
from tpzoo.parallel.token_ids import assert_in_range


def _acc_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _here(target: Tensor, start: int, n_real: int, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(local ids, clamped to 0 off this rank; whether the target is a real column of this rank)."""
    local = target - start
    here = (local >= 0) & (local < n_real) & (target != ignore_index)
    return local.masked_fill(~here, 0), here


def _torch_stats(logits: Tensor, target: Tensor, start: int, n_real: int, ignore_index: int,
                 smoothing: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Pass 1 with torch ops: (m, [s, z_t, sum_z], e) as the Triton pass, plus e = exp(z - m)
    [rows, part] in float32 (float64), 0 on padding columns: pass 2 rescales it in place."""
    acc = _acc_dtype(logits)
    real = logits[:, :n_real]  # a view
    m = real.amax(-1).to(acc) if n_real else logits.new_full(logits.shape[:1], float("-inf"), dtype=acc)
    e = logits - m.unsqueeze(-1)  # the one [rows, part] buffer, in acc (m's dtype)
    e[:, n_real:] = float("-inf")
    e = e.exp_()
    local, here = _here(target, start, n_real, ignore_index)
    z_t = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).to(acc).masked_fill_(~here, 0.0)
    total = real.sum(-1, dtype=acc) if smoothing else torch.zeros_like(m)
    return m, torch.stack([e.sum(-1), z_t, total]), e


def _torch_grad(e: Tensor, m: Tensor, target: Tensor, lse: Tensor, start: int, n_real: int, ignore_index: int,
                smoothing: float, vocab_size: int) -> Tensor:
    """Pass 2 with torch ops, in place on pass 1's e: exp(z - L) = e exp(m - L); float32 (float64).
    Rows of ignored targets are left as they are: backward zeroes them."""
    g = e.mul_((m - lse).exp().unsqueeze(-1))
    if smoothing:
        g[:, :n_real] -= smoothing / vocab_size
    local, here = _here(target, start, n_real, ignore_index)
    return g.scatter_add_(-1, local.unsqueeze(-1), here.to(g.dtype).mul_(smoothing - 1.0).unsqueeze(-1))


@torch.library.custom_op("tpzoo::cross_entropy_stats", mutates_args=())
def _triton_stats(logits: Tensor, target: Tensor, start: int, n_real: int, ignore_index: int,
                  smoothing: bool) -> tuple[Tensor, Tensor]:
    """Pass 1 as a Triton kernel (tpzoo.kernels' cross_entropy.stats, imported on first call)."""
    return kernel_module("cross_entropy", logits.device).stats(logits, target, start, n_real, ignore_index, smoothing)


@_triton_stats.register_fake
def _(logits, target, start, n_real, ignore_index, smoothing):
    return (logits.new_empty(logits.shape[:1], dtype=_acc_dtype(logits)),
            logits.new_empty((3, logits.shape[0]), dtype=_acc_dtype(logits)))


@torch.library.custom_op("tpzoo::cross_entropy_grad", mutates_args=())
def _triton_grad(logits: Tensor, target: Tensor, lse: Tensor, start: int, n_real: int, ignore_index: int,
                 smoothing: float, vocab_size: int) -> Tensor:
    """Pass 2 as a Triton kernel (cross_entropy.grad): the gradient [rows, part] in the logits' dtype."""
    return kernel_module("cross_entropy", logits.device).grad(logits, target, lse, start, n_real, ignore_index,
                                                              smoothing, vocab_size)


@_triton_grad.register_fake
def _(logits, target, lse, start, n_real, ignore_index, smoothing, vocab_size):
    return logits.new_empty(logits.shape)


def _global_stats(m: Tensor, stats: Tensor, group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """Pass 1's per-rank (m, [s, z_t, sum_z]) -> (L [rows], the stats summed over the tp ranks), s
    rescaled to the global max M first: L = M + log sum_r s_r exp(m_r - M). Two all-reduces of O(rows)."""
    if group is not None and dist.get_world_size(group) > 1:
        top = m.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        stats = torch.cat([stats[:1] * (m - top).exp(), stats[1:]])
        dist.all_reduce(stats, group=group)
        m = top
    return m + stats[0].log(), stats


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, label_smoothing: float, ignore_index: int, vocab_size: int,
                group: dist.ProcessGroup | None, backend: str | None) -> Tensor:
        part = logits.shape[-1]
        start = 0 if group is None else dist.get_rank(group) * part
        n_real = min(max(vocab_size - start, 0), part)
        assert_in_range(target, vocab_size, "targets", ignore_index)
        rows = logits.reshape(-1, part)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        flat = target.reshape(-1).contiguous()
        where = (start, n_real, ignore_index)
        triton = use_triton(logits, backend)
        pass1 = (_triton_stats if triton else _torch_stats)(rows, flat, *where, bool(label_smoothing))
        lse, stats = _global_stats(pass1[0], pass1[1], group)
        if triton:
            grad = _triton_grad(rows, flat, lse, *where, float(label_smoothing), vocab_size)
        else:
            grad = _torch_grad(pass1[2], pass1[0], flat, lse, *where, label_smoothing, vocab_size)
        ignored = target == ignore_index
        ctx.save_for_backward(grad, ignored)
        ctx.dtype = logits.dtype
        loss = lse - stats[1]
        if label_smoothing:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - stats[2] / vocab_size)
        return loss.view(target.shape).masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad, ignored = ctx.saved_tensors
        scale = grad_loss.masked_fill(ignored, 0.0).reshape(-1, 1)
        grad = grad.mul_(scale).to(ctx.dtype)  # the torch path's float32 gradient -> the logits' dtype
        return grad.view(*ignored.shape, grad.shape[-1]), None, None, None, None, None, None


def cross_entropy(logits: Tensor, target: Tensor, label_smoothing: float = 0.0, ignore_index: int = -100, *,
                  vocab_size: int | None = None, tp_group: dist.ProcessGroup | None = None,
                  backend: str | None = None) -> Tensor:
    """``vocab_parallel_cross_entropy`` where tp_group None means the whole vocabulary is in ``logits``
    (no process group needed): then it equals F.cross_entropy(logits[..., :V], target, reduction="none")."""
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    padded = logits.shape[-1] * tp
    vocab_size = padded if vocab_size is None else vocab_size
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: "
                         f"logits must be target's shape plus a vocabulary dim")
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must lie in [1, {padded}] (tp x local vocabulary "
                         f"{tp} x {logits.shape[-1]})")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1), got {label_smoothing}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if target.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"target must hold int32/int64 class ids, got {target.dtype}")
    return _VocabParallelCrossEntropy.apply(logits, target, label_smoothing, ignore_index, vocab_size, tp_group,
                                            backend)


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, label_smoothing: float = 0.0,
                                 ignore_index: int = -100, vocab_size: int | None = None,
                                 tp_group: dist.ProcessGroup | None = None, backend: str | None = None) -> Tensor:
    """Per-token cross entropy shaped like ``target``, float32 (float64 for float64 logits); 0 where
    target == ignore_index.

    logits: [..., V'/tp], this rank's slice of a vocabulary padded to V' (e.g. the output of a
    ColumnParallelLinear or of a VocabParallelEmbedding's weight), any float dtype; target: [...]
    global ids in [0, V) or ignore_index (checked on the device, asynchronously). ``vocab_size``: the
    real V <= V' (columns past it are padding and never count); defaults to V' = tp x logits.shape[-1].
    ``tp_group``: None takes the mesh's. ``backend``: tpzoo.kernels' choice (auto | triton | torch; None
    reads TPZOO_KERNELS). Equals ``F.cross_entropy(full_logits[..., :V], target, reduction="none",
    ignore_index=..., label_smoothing=...)``.
    """
    return cross_entropy(logits, target, label_smoothing, ignore_index, vocab_size=vocab_size,
                         tp_group=resolve_tp_group(tp_group), backend=backend)
