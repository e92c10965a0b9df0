"""The transformer block: attention and MLP sublayers with residual connections, their norms,
bias-dropout-add and sequence parallelism (activation recompute wraps whole layers: ``recompute``).

    pre-norm  (GPT, Llama): x = x + drop(Attn(N_a(x)) + b_o);      x = x + drop(MLP(N_m(x)) + b_2)
    post-norm (BERT):       x = N_a(x + drop(Attn(x) + b_o));      x = N_m(x + drop(MLP(x) + b_2))

The block is handed its four parts (any attention, MLP and norm blocks of ``tpzoo.models``) and the
plan; it owns only the residual wiring. Activations between the sublayers are [b, s, h], replicated
on the tp ranks, or with ``plan.sequence_parallel`` [b, s/tp, h], each rank holding a slice of the
sequence; then residual dropout draws from the "tp" stream (the norms mark their own parameters).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo.models.kv_cache import KVCache
from tpzoo.parallel import ParallelMesh, ParallelPlan


@torch.compiler.disable  # swaps generator states, which dynamo cannot trace: compiled blocks call it eagerly
def in_tp_stream(mesh: ParallelMesh, fn: Callable[..., Tensor], *args: Any, **kwargs: Any) -> Tensor:
    """``fn(*args, **kwargs)`` drawing its random numbers from the mesh's "tp" stream (``mesh.rng.fork()``):
    dropout on activations split across the tp ranks, each rank its own mask."""
    with mesh.rng.fork():
        return fn(*args, **kwargs)


def hidden_dropout(x: Tensor, p: float, training: bool, mesh: ParallelMesh, sequence_parallel: bool) -> Tensor:
    """Dropout on the residual stream: the default stream when x is replicated on the tp ranks (the
    same mask everywhere), the "tp" stream when x is a sequence shard (each shard its own mask)."""
    if not training or p == 0.0:
        return x
    if sequence_parallel:
        return in_tp_stream(mesh, F.dropout, x, p, training=True)
    return F.dropout(x, p, training=True)


class TransformerLayer(nn.Module):
    """One block: [b, s, h] -> [b, s, h] ([b, s/tp, h] with sequence parallelism).

    ``self_attention`` returns (y, bias or None) and takes (x, mask, cache); ``mlp`` returns (y, bias
    or None). ``norm_position``: "pre" or "post" (see module docstring). ``mask``: bool, True = masked
    out, broadcastable to the scores [b, n, s, s] (BERT's padding mask [b, 1, 1, s]), or None.
    ``StagedModel.run_layers`` recomputes it in backward under ``plan.recompute_activations``.
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

    def _bias_dropout_add(self, y: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
        y = y if bias is None else y + bias
        return residual + hidden_dropout(y, self.hidden_dropout, self.training, self.plan.mesh,
                                         self.plan.sequence_parallel)

    def forward(self, x: Tensor, mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        if self.norm_position == "pre":
            x = self._bias_dropout_add(*self.self_attention(self.attention_norm(x), mask, cache), x)
            return self._bias_dropout_add(*self.mlp(self.mlp_norm(x)), x)
        x = self.attention_norm(self._bias_dropout_add(*self.self_attention(x, mask, cache), x))
        return self.mlp_norm(self._bias_dropout_add(*self.mlp(x), x))
