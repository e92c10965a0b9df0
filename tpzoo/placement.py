"""Where a sequence's tokens sit, and the attention mask that follows from it, without a dense [s, s] mask per
sample: what plain attention and context parallelism's attention (``tpzoo.parallel.context_attention``) both read.

A rank under context parallelism holds pieces of every sequence (the load-balanced cut gives it two chunks), so a
token's place is not its index in the tensor: ``Placement`` says it, and travels with keys round the ring.

    placed = Placement(index, doc=document_ids, valid=attention_mask.bool())
    mask = hidden(placed, placed, causal=True)     # bool [b | 1, 1, sq, sk], True = hidden (Megatron-LM's convention)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


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
