"""Attention over a sequence split across the cp ranks of context parallelism, two ways: ring attention (``p2p``, keys
and values passed round the ring) and DeepSpeed-Ulysses (``a2a``, heads scattered by an all-to-all).

Ring attention. Each of the c ranks of a cp group holds s/c of every sequence (its queries, keys and values, and what
places them: global positions, document ids, padding). In c steps every rank meets every block of keys: step t
attends its queries to the block of rank (r - t) mod c, then passes that block on to rank r + 1 (batched
isend/irecv). The blocks' partial results merge through their log-sum-exp (Liu et al. 2023, "Ring Attention";
Megatron-LM's p2p context parallelism):

    S_j   = Q K_j^T / sqrt(d), masked         [b, n, sq, sk_j]   block j's scores
    l_j   = logsumexp_k S_j                    [b, n, sq, 1]      (-inf where no key of block j is visible)
    O_j   = softmax_k(S_j) V_j                 [b, n, sq, d]
    L     = logsumexp_j l_j,   O = sum_j exp(l_j - L) O_j         = softmax(Q K^T / sqrt(d) + M) V exactly

The backward pass is the same ring run backwards: the ring shift is an autograd function whose conjugate sends the
keys' and values' gradients to rank r - 1, so each block's gradient returns to its owner. Memory: a rank keeps its
queries' scores against every block, s/c x s a head, 1/c of the whole attention's.

The mask is built from what travels with each block, never as a dense [s, s] tensor: causal (a key at a global
position after the query's is hidden), a sliding window, documents (``doc`` ids: a key of another document is hidden)
and padding (``valid``: False keys are hidden)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Placement:
    """What places this rank's tokens in the whole sequence: global ``positions`` [s_local] (long), and optionally
    ``doc`` [b, s_local] (the document of each token) and ``valid`` [b, s_local] (bool, False = padding)."""

    positions: Tensor
    doc: Tensor | None = None
    valid: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.positions, self.doc, self.valid) if t is not None]

    def like(self, tensors: list[Tensor]) -> "Placement":
        it = iter(tensors)
        return Placement(next(it), next(it) if self.doc is not None else None,
                         next(it) if self.valid is not None else None)


def hidden(q: Placement, k: Placement, causal: bool, window: int | None = None) -> Tensor | None:
    """The mask of queries placed at ``q`` against keys placed at ``k``: bool, broadcastable to [b, 1, sq, sk], True =
    hidden; None when nothing is."""
    out = None
    if causal:
        qp, kp = q.positions[:, None], k.positions[None, :]
        out = kp > qp
        if window is not None:
            out = out | (kp <= qp - window)
        out = out[None, None]
    if q.doc is not None:
        other = (q.doc[:, :, None] != k.doc[:, None, :])[:, None]
        out = other if out is None else out | other
    if k.valid is not None:
        pad = ~k.valid[:, None, None, :]
        out = pad if out is None else out | pad
    return out


def _shift(x: Tensor, group: dist.ProcessGroup, step: int) -> Tensor:
    """``x`` of rank r - step of ``group`` (this rank's ``x`` goes to rank r + step), by batched isend/irecv."""
    if x.dtype == torch.bool:  # gloo sends no bool tensors
        return _shift(x.to(torch.uint8), group, step).bool()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too: gloo fills the memory in order
    ops = [dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + step) % size), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (rank - step) % size), group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return out


class _RingShift(torch.autograd.Function):
    """Forward: rank r's tensor to rank r + 1. Backward: the gradient back to rank r - 1, where the tensor came
    from."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _shift(grad, ctx.group, -1), None


def _block(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """(O_j [b, n, sq, d], l_j [b, n, sq, 1]) of one block of keys; l_j = -inf for queries that see none of it."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None:
        return torch.softmax(scores, -1).matmul(v), torch.logsumexp(scores, -1, keepdim=True)
    # a large finite fill keeps the gradient of rows with no visible key finite; their weight in the merge is 0
    scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    lse = torch.logsumexp(scores, -1, keepdim=True)
    seen = (~mask).any(-1, keepdim=True)
    return torch.softmax(scores, -1).matmul(v), torch.where(seen, lse, float("-inf"))


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, placed: Placement, *,
                   causal: bool = True, window: int | None = None) -> Tensor:
    """softmax(Q K^T / sqrt(d) + M) V over the whole sequence for this rank's queries (module docstring).

    q [b, n, sq, d], k and v [b, n, sk, d] (sk = sq: this rank's tokens; kv heads already repeated to n), ``placed``
    where this rank's tokens sit (each rank may hold any positions: the load-balanced cut gives each two chunks).
    Returns [b, n, sq, d]. A query that sees no key at all (a padding query whose whole sequence is padding) gets
    zeros."""
    size = dist.get_world_size(group)
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs, lses, kv, at = [], [], (k, v), placed
    for step in range(size):
        o, lse = _block(q, *kv, hidden(placed, at, causal, window), scale)
        outs.append(o)
        lses.append(lse)
        if step + 1 < size:
            kv = tuple(_RingShift.apply(t, group) for t in kv)
            at = at.like([_shift(t, group, 1) for t in at.tensors()])
    # exp(l_j - L) as a softmax over the blocks, written out: logsumexp's gradient is NaN where every l_j is -inf
    lse = torch.stack(lses)                                                  # [c, b, n, sq, 1]
    top = lse.detach().amax(0)
    weights = torch.exp(lse - torch.where(torch.isinf(top), 0.0, top))     # 0 for a block a query does not see
    total = weights.sum(0)
    return (weights * torch.stack(outs)).sum(0) / torch.where(total == 0, 1.0, total)


class _AllToAll(torch.autograd.Function):
    """Forward: piece i of dim 0 of ``x`` [c, ...] to rank i, piece j of the result from rank j. Its conjugate is
    itself."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None


def heads_to_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[b, n, s/c, d] (this rank's tokens, every head) -> [b, n/c, s, d] (rank r's n/c heads, every rank's tokens,
    rank by rank): DeepSpeed-Ulysses' first all-to-all. n must divide by c."""
    c = dist.get_world_size(group)
    b, n, s, d = x.shape
    if n % c:
        raise ValueError(f"all-to-all context parallelism splits the {n} heads of this rank over cp={c} ranks: "
                         f"cp must divide them")
    pieces = _AllToAll.apply(x.reshape(b, c, n // c, s, d).transpose(0, 1), group)  # [c (source), b, n/c, s, d]
    return pieces.permute(1, 2, 0, 3, 4).reshape(b, n // c, c * s, d)


def sequence_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The inverse of ``heads_to_sequence``: [b, n/c, s, d] -> [b, n, s/c, d]."""
    c = dist.get_world_size(group)
    b, h, s, d = x.shape
    pieces = _AllToAll.apply(x.reshape(b, h, c, s // c, d).permute(2, 0, 1, 3, 4), group)  # [c (source), b, h, s/c, d]
    return pieces.transpose(0, 1).reshape(b, c * h, s // c, d)


def gather_placement(placed: Placement, group: dist.ProcessGroup) -> Placement:
    """Every rank's ``placed``, concatenated rank by rank along the sequence (the order ``heads_to_sequence`` gives)."""
    def gather(t: Tensor) -> Tensor:
        wire = t.to(torch.uint8) if t.dtype == torch.bool else t
        parts = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, wire.contiguous(), group=group)
        return torch.cat(parts, -1).to(t.dtype)
    return placed.like([gather(t) for t in placed.tensors()])


def all_to_all_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, placed: Placement, *,
                         causal: bool = True, window: int | None = None) -> Tensor:
    """The same attention as ``ring_attention`` by DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all gives each
    rank n/c heads of the whole sequence, plain attention runs on them (torch's SDPA with the mask of the gathered
    placement), a second all-to-all returns this rank's tokens of every head. q, k, v [b, n, s/c, d] -> [b, n, s/c,
    d]; n must divide by c."""
    whole = gather_placement(placed, group)
    q, k, v = (heads_to_sequence(t, group) for t in (q, k, v))
    mask = hidden(whole, whole, causal, window)
    if mask is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    else:  # a query that sees no key gets zeros, as in ring_attention (SDPA would give NaN)
        seen = (~mask).any(-1, keepdim=True)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~mask | ~seen) * seen
    return sequence_to_heads(out, group)
