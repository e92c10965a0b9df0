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
    L     = logsumexp_j l_j,   O = sum_j exp(l_j - L) O_j         = softmax(Q K^T / sqrt(d) + M) V exactly,

merged online as the blocks arrive. Backward passes the keys and values round the ring again with each block's
gradients so far, recomputing each block's probabilities from L (``_RingAttention``): a rank keeps only its s/c
queries, keys, values, output and L, as FlashAttention does, and at most one [s/c, s/c] block of scores at a time.
Each step starts sending its block on (and, backward, the gradients of the block before) before it computes, so
the transfers overlap the compute (``_pass_on``: gloo's sends run in threads of their own, NCCL's on its stream).

The mask is built from what travels with each block, one [s/c, s/c] block at a time, never as a dense [s, s] tensor:
causal (a key at a global position after the query's is hidden), a sliding window, documents (``doc`` ids: a key of
another document is hidden) and padding (``valid``: False keys are hidden). A2A gathers the placement and, where
nothing but causality hides a key, runs SDPA's causal kernel with no mask at all, else a block of queries at a time
(``tpzoo.placement.by_query_blocks``)."""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from tpzoo.placement import Placement, by_query_blocks, hidden


def _pass_on(tensors: list[Tensor], group: dist.ProcessGroup) -> Callable[[], list[Tensor]]:
    """Start sending ``tensors`` to rank r + 1 of ``group`` and receiving rank r - 1's (one batched isend/irecv);
    the returned call waits for them. What runs in between overlaps the transfer."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    wire = [(t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous() for t in tensors]  # gloo: no bool
    out = [torch.empty_like(t) for t in wire]  # contiguous too: gloo fills the memory in order
    ahead, behind = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    ops = [op for x, y in zip(wire, out) for op in (dist.P2POp(dist.isend, x, ahead, group),
                                                    dist.P2POp(dist.irecv, y, behind, group))]
    requests = dist.batch_isend_irecv(ops)

    def wait() -> list[Tensor]:
        for request in requests:
            request.wait()
        return [y.bool() if t.dtype == torch.bool else y for t, y in zip(tensors, out)]
    return wait


def _moved(kv: tuple[Tensor, ...], at: Placement, group: dist.ProcessGroup) -> Callable[[], tuple[tuple, Placement]]:
    """``_pass_on`` of a block's keys and values and their placement: the call returns rank r - 1's."""
    wait = _pass_on([*kv, *at.tensors()], group)

    def arrived() -> tuple[tuple, Placement]:
        got = wait()
        return tuple(got[:len(kv)]), at.like(got[len(kv):])
    return arrived


def _dropout_mask(shape: torch.Size, p: float, like: Tensor) -> Tensor:
    """Kept entries 1 / (1 - p), dropped 0, drawn from the default generator of ``like``'s device."""
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(1 - p) / (1 - p)


def _probs(q: Tensor, k: Tensor, mask: Tensor | None, scale: float, lse: Tensor | None = None
           ) -> tuple[Tensor, Tensor]:
    """(exp(S_j - l) [b, n, sq, sk] float32, l [b, n, sq, 1]) of block j's scores S_j = Q K_j^T / sqrt(d): l its
    own log-sum-exp (-inf for a query that sees none of its keys), or ``lse`` given; 0 where hidden."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, -1, keepdim=True)
    return torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)), lse


class _RingAttention(torch.autograd.Function):
    """Ring attention with FlashAttention's memory: forward keeps q, k, v, O and L (s/c tokens a rank) and merges the
    blocks online; backward passes the keys and values round the ring again, recomputes each block's probabilities
    from L (P_j = exp(S_j - L)) and sends each block's dK_j, dV_j along with it, home after c moves:

        dV_j = P_j^T dO,   dS_j = P_j (dO V_j^T - D) with D = rowsum(dO O),   dQ = sum_j dS_j K_j / sqrt(d),
        dK_j = dS_j^T Q / sqrt(d)

    With dropout (on P_j, the same as on the whole softmax), backward draws each block's mask again from the
    generator state forward started from."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, placed: Placement, group: dist.ProcessGroup, causal: bool,
                window: int | None, dropout: float) -> Tensor:
        scale, size = 1.0 / math.sqrt(q.shape[-1]), dist.get_world_size(group)
        ctx.rng = torch.get_rng_state() if q.device.type == "cpu" else torch.cuda.get_rng_state(q.device)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), device=q.device)
        kv, at = (k, v), placed
        for step in range(size):
            arriving = _moved(kv, at, group) if step + 1 < size else None  # the next block, meanwhile
            probs, block = _probs(q, kv[0], hidden(placed, at, causal, window), scale)
            if dropout > 0:
                probs = probs * _dropout_mask(probs.shape, dropout, probs)
            new = torch.logaddexp(lse, block)
            safe = torch.where(torch.isinf(new), 0.0, new)
            out = out * torch.exp(lse - safe) + probs.to(q.dtype).matmul(kv[1]).float() * torch.exp(block - safe)
            lse = new
            if arriving is not None:
                kv, at = arriving()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.placed, ctx.group, ctx.causal, ctx.window, ctx.dropout = placed, group, causal, window, dropout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, size = ctx.group, dist.get_world_size(ctx.group)
        scale, grad = 1.0 / math.sqrt(q.shape[-1]), grad.float()
        d = (grad * out).sum(-1, keepdim=True)                                     # [b, n, sq, 1]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, at, gradients = (k, v), ctx.placed, None  # gradients: the held block's dK, dV so far, arriving
        cuda = q.device.type == "cuda"
        with torch.random.fork_rng(devices=[q.device] if cuda else []):
            torch.cuda.set_rng_state(ctx.rng, q.device) if cuda else torch.set_rng_state(ctx.rng)
            for step in range(size):
                arriving = _moved(kv, at, group) if step + 1 < size else None
                probs, _ = _probs(q, kv[0], hidden(ctx.placed, at, ctx.causal, ctx.window), scale, lse)
                dp, kept = grad.matmul(kv[1].float().transpose(-1, -2)), probs
                if ctx.dropout > 0:
                    drop = _dropout_mask(probs.shape, ctx.dropout, probs)
                    dp, kept = dp * drop, probs * drop
                ds = probs * (dp - d)
                dq += ds.matmul(kv[0].float()) * scale
                dk = ds.transpose(-1, -2).matmul(q.float()) * scale
                dv = kept.transpose(-1, -2).matmul(grad)
                if gradients is not None:
                    before = gradients()
                    dk, dv = before[0] + dk, before[1] + dv
                gradients = _pass_on([dk, dv], group)  # after c moves each block's are home
                if arriving is not None:
                    kv, at = arriving()
            dk, dv = gradients()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, placed: Placement, *, group: dist.ProcessGroup,
                   causal: bool = True, window: int | None = None, dropout: float = 0.0) -> Tensor:
    """softmax(Q K^T / sqrt(d) + M) V over the whole sequence for this rank's queries (module docstring).

    q [b, n, sq, d], k and v [b, n, sk, d] (sk = sq: this rank's tokens; kv heads already repeated to n), ``placed``
    where this rank's tokens sit (each rank may hold any positions: the load-balanced cut gives each two chunks);
    ``dropout``: on the probabilities. Returns [b, n, sq, d]. A query that sees no key at all (a padding query whose
    whole sequence is padding) gets zeros."""
    return _RingAttention.apply(q, k, v, placed, group, causal, window, dropout)


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


def all_to_all_attention(q: Tensor, k: Tensor, v: Tensor, placed: Placement, *, group: dist.ProcessGroup,
                         causal: bool = True, window: int | None = None, dropout: float = 0.0) -> Tensor:
    """The same attention as ``ring_attention`` by DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all gives each
    rank n/c heads of the whole sequence, plain attention runs on them (torch's SDPA, on the sequence put back in
    order: causal without a mask where nothing else is hidden, else with the mask of the gathered placement), a second
    all-to-all returns this rank's tokens of every head. q, k, v [b, n, s/c, d] -> [b, n, s/c, d]; n must divide by
    c. The ranks' pieces together hold the whole sequence, as the engine's cut gives them."""
    whole = gather_placement(placed, group)
    order = torch.argsort(whole.index)                          # the load-balanced cut's chunks back in order
    q, k, v = (heads_to_sequence(t, group).index_select(2, order) for t in (q, k, v))
    whole = Placement(whole.index[order], None if whole.doc is None else whole.doc[:, order],
                      None if whole.valid is None else whole.valid[:, order])
    if whole.doc is None and whole.valid is None and window is None:  # the pieces cover the sequence: 0 .. s-1
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)
    else:
        def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
            seen = (~mask).any(-1, keepdim=True)  # a query that sees no key: zeros, as in ring_attention (not NaN)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~mask | ~seen,
                                                                    dropout_p=dropout) * seen
        out = by_query_blocks(attend, q, k, v, whole, causal, window)
    return sequence_to_heads(out.index_select(2, torch.argsort(order)), group)


MODES = {"p2p": ring_attention, "a2a": all_to_all_attention}


def context_attention(group: dist.ProcessGroup, comm_type: str) -> Callable[..., Tensor]:
    """The attention of ``CoreAttention.context_parallel`` for the cp ranks of ``group``: ring attention (``p2p``) or
    DeepSpeed-Ulysses (``a2a``), called as (q, k, v, placement, causal=, window=, dropout=)."""
    if comm_type not in MODES:
        raise ValueError(f"cp comm type must be one of {', '.join(MODES)}, got {comm_type!r}")
    return functools.partial(MODES[comm_type], group=group)
