"""The transformer block: attention and MLP sublayers with residual connections, their norms,
bias-dropout-add, optional activation recompute and sequence parallelism.

    pre-norm  (GPT, Llama): x = x + drop(Attn(N_a(x)) + b_o);      x = x + drop(MLP(N_m(x)) + b_2)
    post-norm (BERT):       x = N_a(x + drop(Attn(x) + b_o));      x = N_m(x + drop(MLP(x) + b_2))

The block is handed its four parts (any attention, MLP and norm blocks of ``tpzoo.models``) and the
plan; it owns only the residual wiring. Activations between the sublayers are [b, s, h], replicated
on the tp ranks, or with ``plan.sequence_parallel`` [b, s/tp, h], each rank holding a slice of the
sequence; then residual dropout draws from the "tp" stream (the norms mark their own parameters).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tpzoo.models.kv_cache import KVCache
from tpzoo.parallel import ParallelMesh, ParallelPlan, RNGStatesTracker


def hidden_dropout(x: Tensor, p: float, training: bool, mesh: ParallelMesh, sequence_parallel: bool) -> Tensor:
    """Dropout on the residual stream: the default stream when x is replicated on the tp ranks (the
    same mask everywhere), the "tp" stream when x is a sequence shard (each shard its own mask)."""
    if not training or p == 0.0:
        return x
    with mesh.rng.fork() if sequence_parallel else nullcontext():
        return F.dropout(x, p, training=True)


class _Replay:
    """Sets the tracker's streams back to ``saved`` for the block, then restores them. Re-enterable:
    a zero-bubble schedule's split backward (input, then weights) recomputes a layer twice."""

    def __init__(self, tracker: RNGStatesTracker) -> None:
        self.tracker, self.saved, self.current = tracker, dict(tracker.states), {}

    def __enter__(self) -> None:
        self.current = dict(self.tracker.states)
        self.tracker.states.update(self.saved)

    def __exit__(self, *exc: object) -> None:
        self.tracker.states.update(self.current)


def _rng_contexts(tracker: RNGStatesTracker) -> tuple[AbstractContextManager, AbstractContextManager]:
    """For ``checkpoint(context_fn=...)``: the recompute replays the tracker's streams from where the
    forward found them, so dropout under ``mesh.rng.fork()`` draws the same masks twice (checkpoint
    itself restores only the default generator)."""
    return nullcontext(), _Replay(tracker)


class TransformerLayer(nn.Module):
    """One block: [b, s, h] -> [b, s, h] ([b, s/tp, h] with sequence parallelism).

    ``self_attention`` returns (y, bias or None) and takes (x, mask, cache); ``mlp`` returns (y, bias
    or None). ``norm_position``: "pre" or "post" (see module docstring). ``mask``: bool, True = masked
    out, broadcastable to the scores [b, n, s, s] (BERT's padding mask [b, 1, 1, s]), or None. With
    ``plan.recompute_activations`` only the input is kept for backward and the block's forward runs
    again inside it.
    """

    def __init__(self, self_attention: nn.Module, mlp: nn.Module, attention_norm: nn.Module, mlp_norm: nn.Module,
                 plan: ParallelPlan, *, hidden_dropout: float = 0.0, norm_position: str = "pre") -> None:
        super().__init__()
        if norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be 'pre' or 'post', got {norm_position!r}")
        self.plan, self.hidden_dropout, self.norm_position = plan, hidden_dropout, norm_position
        self.attention_norm = attention_norm
        self.self_attention = self_attention
        self.mlp_norm = mlp_norm
        self.mlp = mlp

    def forward(self, x: Tensor, mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        if self.plan.recompute_activations and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, mask, cache, use_reentrant=False,
                              context_fn=partial(_rng_contexts, self.plan.mesh.rng))
        return self._forward(x, mask, cache)

    def _bias_dropout_add(self, y: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
        y = y if bias is None else y + bias
        return residual + hidden_dropout(y, self.hidden_dropout, self.training, self.plan.mesh,
                                         self.plan.sequence_parallel)

    def _forward(self, x: Tensor, mask: Tensor | None, cache: KVCache | None = None) -> Tensor:
        if self.norm_position == "pre":
            x = self._bias_dropout_add(*self.self_attention(self.attention_norm(x), mask, cache), x)
            return self._bias_dropout_add(*self.mlp(self.mlp_norm(x)), x)
        x = self.attention_norm(self._bias_dropout_add(*self.self_attention(x, mask, cache), x))
        return self.mlp_norm(self._bias_dropout_add(*self.mlp(x), x))
