"""The transformer layer: attention and MLP sublayers with residual connections, LayerNorm,
bias-dropout-add, optional activation recompute and sequence parallelism.

    pre-LN  (GPT):  x = x + drop(Attn(LN_a(x)) + b_o);      x = x + drop(MLP(LN_m(x)) + b_2)
    post-LN (BERT): x = LN_a(x + drop(Attn(x) + b_o));      x = LN_m(x + drop(MLP(x) + b_2))

Activations between the sublayers are [b, s, h], replicated on the tp ranks, or with sequence
parallelism [b, s/tp, h], each rank holding a slice of the sequence; then the LayerNorm weights
are marked ``sequence_parallel`` (their gradients are partial sums that
``sync_sequence_parallel_grads`` completes) and residual dropout draws from the "tp" stream.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tpzoo import kernels as K
from tpzoo.models.attention import ParallelAttention
from tpzoo.models.config import TransformerConfig
from tpzoo.models.kv_cache import KVCache
from tpzoo.models.mlp import ParallelMLP
from tpzoo.parallel import ParallelMesh, RNGStatesTracker


class LayerNorm(nn.Module):
    """LayerNorm over the last dim through ``tpzoo.kernels.layer_norm``; weight 1, bias 0 at init.

    ``sequence_parallel``: it normalizes a sequence shard, so its parameters are marked for
    ``sync_sequence_parallel_grads``.
    """

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool = False,
                 kernels: str | None = None) -> None:
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return K.layer_norm(x, self.weight, self.bias, self.eps, backend=self.kernels)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, sequence_parallel={self.weight.sequence_parallel}"


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
    """One layer: [b, s, h] -> [b, s, h] ([b, s/tp, h] with sequence parallelism).

    ``mask``: bool, True = masked out, broadcastable to the scores [b, n, s, s] (BERT's padding
    mask [b, 1, 1, s]), or None. With ``recompute_activations`` only the input is kept for backward
    and the layer's forward runs again inside it.
    """

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh, layer_number: int) -> None:
        super().__init__()
        self.config, self.mesh, self.layer_number = config, mesh, layer_number
        sp, eps, kernels = config.sequence_parallel, config.layernorm_epsilon, config.kernels
        self.attention_norm = LayerNorm(config.hidden_size, eps, sp, kernels)
        self.self_attention = ParallelAttention(config, mesh, layer_number)
        self.mlp_norm = LayerNorm(config.hidden_size, eps, sp, kernels)
        self.mlp = ParallelMLP(config, mesh)

    def forward(self, x: Tensor, mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        if self.config.recompute_activations and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, mask, cache, use_reentrant=False,
                              context_fn=partial(_rng_contexts, self.mesh.rng))
        return self._forward(x, mask, cache)

    def _bias_dropout_add(self, y: Tensor, bias: Tensor, residual: Tensor) -> Tensor:
        return residual + hidden_dropout(y + bias, self.config.hidden_dropout, self.training, self.mesh,
                                         self.config.sequence_parallel)

    def _forward(self, x: Tensor, mask: Tensor | None, cache: KVCache | None = None) -> Tensor:
        if self.config.layernorm_position == "pre":
            x = self._bias_dropout_add(*self.self_attention(self.attention_norm(x), mask, cache), x)
            return self._bias_dropout_add(*self.mlp(self.mlp_norm(x)), x)
        x = self.attention_norm(self._bias_dropout_add(*self.self_attention(x, mask, cache), x))
        return self.mlp_norm(self._bias_dropout_add(*self.mlp(x), x))
