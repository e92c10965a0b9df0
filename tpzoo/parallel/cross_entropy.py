"""Cross entropy over a vocabulary split across tp ranks, without gathering the logits.

Rank r holds logits z[..., r V'/tp : (r+1) V'/tp] of a vocabulary padded to V' >= V. With
m = max_j z_j (all-reduce MAX), and the target's logit z_t and the partition sum all-reduced
(SUM, in one collective):

    loss = log sum_j exp(z_j - m) - (z_t - m)                       (j over the V real entries)
    with label smoothing e:  (1 - e) loss + e (log sum_j exp(z_j - m) - mean_j (z_j - m))
    d loss / d z_j = softmax_j - (1 - e) [j = t] - e / V,   0 on padding columns and ignored rows

so each rank moves O(tokens) numbers, never O(tokens x V).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tpzoo.parallel.collectives import resolve_tp_group


def _check_targets(target: Tensor, valid: Tensor, vocab_size: int, ignore_index: int) -> None:
    if target.is_cuda:
        torch._assert_async(valid.all(), "target outside [0, vocab size) and not ignore_index")
    elif not bool(valid.all()):
        bad = target[~valid]
        raise IndexError(f"targets must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
                         f"got {bad.min().item()}..{bad.max().item()}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, label_smoothing: float, ignore_index: int,
                vocab_size: int, group: dist.ProcessGroup) -> Tensor:
        part = logits.shape[-1]
        start = dist.get_rank(group) * part
        n_real = min(max(vocab_size - start, 0), part)
        padding = torch.arange(part, device=logits.device) >= n_real
        z = logits.float()
        if n_real < part:  # a copy: the caller's logits stay as they are
            z = z.masked_fill(padding, float("-inf"))
        zmax = z.amax(dim=-1)
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        z = z - zmax.unsqueeze(-1)  # from here on z is ours: in-place ops save passes over [tokens, V/tp]

        ignored = target == ignore_index
        _check_targets(target, ignored | ((target >= 0) & (target < vocab_size)), vocab_size, ignore_index)
        local = target - start
        here = (local >= 0) & (local < n_real) & ~ignored
        local = local.masked_fill(~here, 0)
        stats = [z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)]
        if label_smoothing:
            stats.append(z.masked_fill(padding, 0.0).sum(dim=-1))
        exp = z.exp_()
        stats.insert(1, exp.sum(dim=-1))
        stats = torch.stack(stats)
        dist.all_reduce(stats, group=group)
        log_z = stats[1].log()
        loss = log_z - stats[0]
        if label_smoothing:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - stats[2] / vocab_size)
        loss = loss.masked_fill(ignored, 0.0)

        ctx.save_for_backward(exp.div_(stats[1].unsqueeze(-1)), local, here, ignored, padding)
        ctx.label_smoothing, ctx.vocab_size, ctx.dtype = label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local, here, ignored, padding = ctx.saved_tensors
        eps = ctx.label_smoothing
        # The saved softmax is used once (no double backward): turn it into the gradient in place.
        grad = softmax.scatter_add_(-1, local.unsqueeze(-1), -(1.0 - eps) * here.to(softmax.dtype).unsqueeze(-1))
        if eps:
            grad.sub_((eps / ctx.vocab_size) * (~padding).to(grad.dtype))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, label_smoothing: float = 0.0,
                                 ignore_index: int = -100, vocab_size: int | None = None,
                                 tp_group: dist.ProcessGroup | None = None) -> Tensor:
    """Per-token cross entropy, float32, shaped like ``target``; 0 where target == ignore_index.

    logits: [..., V'/tp], this rank's slice of a vocabulary padded to V' (e.g. the output of a
    ColumnParallelLinear or of a VocabParallelEmbedding's weight); target: [...] global ids.
    ``vocab_size``: the real V <= V' (columns past it are padding and never count); defaults to
    V' = tp x logits.shape[-1]. Equals ``F.cross_entropy(full_logits[..., :V], target,
    reduction="none", ignore_index=..., label_smoothing=...)``.
    """
    group = resolve_tp_group(tp_group)
    padded = logits.shape[-1] * dist.get_world_size(group)
    vocab_size = padded if vocab_size is None else vocab_size
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: "
                         f"logits must be target's shape plus a vocabulary dim")
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must lie in [1, {padded}] (tp x local vocabulary "
                         f"{dist.get_world_size(group)} x {logits.shape[-1]})")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1), got {label_smoothing}")
    if target.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"target must hold int32/int64 class ids, got {target.dtype}")
    return _VocabParallelCrossEntropy.apply(logits, target, label_smoothing, ignore_index, vocab_size, group)
