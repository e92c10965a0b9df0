"""Where a sequence's tokens sit, and the attention mask that follows from it, without a dense [s, s] mask per
sample: what plain attention and context parallelism's attention (``tpzoo.parallel.context_attention``) both read.

A rank under context parallelism holds pieces of every sequence (the load-balanced cut gives it two chunks), so a
token's place is not its index in the tensor: ``Placement`` says it, and travels with keys round the ring.

    placed = Placement(index, doc=document_ids, valid=attention_mask.bool())
    mask = hidden(placed, placed, causal=True)     # bool [b | 1, 1, sq, sk], True = hidden (Megatron-LM's convention)
    out = by_query_blocks(attend, q, k, v, placed, causal=True)   # a long sequence: QUERY_BLOCK queries at a time
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

QUERY_BLOCK = 2048  # queries a block whose mask ``by_query_blocks`` makes at a time


@dataclass(frozen=True)
class Placement:
    """This rank's tokens in the whole sequence: ``index`` [s] (long: each token's index in the sequence; causal
    order), ``doc`` [b, s] (the document of each token: packed documents; None: one document), ``valid`` [b, s] (bool,
    False = padding; None: no padding) and ``positions`` ([b, s] or [s]: the positions rotary embeddings turn by,
    e.g. restarting at each document; None: ``index``). Only the first three travel with keys (``tensors``)."""

    index: Tensor
    doc: Tensor | None = None
    valid: Tensor | None = None
    positions: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        """What places keys: index, then doc and valid where given."""
        return [t for t in (self.index, self.doc, self.valid) if t is not None]

    def like(self, tensors: list[Tensor]) -> Placement:
        """A placement of keys from ``tensors`` laid out as ``tensors()`` gives them (e.g. received from a peer)."""
        it = iter(tensors)
        return Placement(next(it), next(it) if self.doc is not None else None,
                         next(it) if self.valid is not None else None)

    @property
    def rotary_positions(self) -> Tensor:
        return self.index if self.positions is None else self.positions


def hidden(q: Placement, k: Placement, causal: bool, window: int | None = None) -> Tensor | None:
    """The mask of queries placed at ``q`` against keys placed at ``k``: bool, broadcastable to [b, 1, sq, sk], True =
    hidden: a later key (``causal``), one ``window`` or more places before the query, one of another document,
    padding. None when nothing is hidden."""
    out = None
    if causal:
        qi, ki = q.index[:, None], k.index[None, :]
        out = ki > qi
        if window is not None:
            out = out | (ki <= qi - window)
        out = out[None, None]
    if q.doc is not None:
        other = (q.doc[:, :, None] != k.doc[:, None, :])[:, None]
        out = other if out is None else out | other
    if k.valid is not None:
        pad = ~k.valid[:, None, None, :]
        out = pad if out is None else out | pad
    return out


def by_query_blocks(attend: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor,
                    placed: Placement, causal: bool, window: int | None = None) -> Tensor:
    """``attend(q_rows, k, v, mask)`` (attention under a bool mask [b | 1, 1, rows, sk], True = hidden) over the
    queries of q [b, n, s, d], ``QUERY_BLOCK`` at a time, each block's mask made from ``placed`` (the tokens of the
    whole sequence) and its attention recomputed in backward (``torch.utils.checkpoint``, the same dropout masks):
    the [s, s] mask is never held. Returns [b, n, s, d]."""
    out = []
    for start in range(0, q.shape[2], QUERY_BLOCK):
        rows = slice(start, start + QUERY_BLOCK)
        queries = Placement(placed.index[rows], None if placed.doc is None else placed.doc[:, rows])
        out.append(checkpoint(attend, q[:, :, rows], k, v, hidden(queries, placed, causal, window),
                              use_reentrant=False))
    return torch.cat(out, 2)
