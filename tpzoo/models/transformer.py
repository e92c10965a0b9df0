"""The transformer block: attention and MLP sublayers with their norms, residual connections and
dropout, in the three arrangements today's models use:

    pre       (GPT, Llama):  x = x + drop(Attn(N_a(x)));   x = x + drop(MLP(N_m(x)))
    post      (BERT):        x = N_a(x + drop(Attn(x)));   x = N_m(x + drop(MLP(x)))
    parallel  (GPT-NeoX):    x = x + drop(Attn(N_a(x))) + drop(MLP(N_m(x)))

The block is handed its four parts (any attention, MLP and norm modules) and owns only the wiring.
Plain PyTorch; ``LAYER_PLAN`` is its sharding plan with the block library's ``Attention`` and ``MLP``.
"""

from __future__ import annotations

from torch import Tensor, nn

from tpzoo.models.attention import ATTENTION_PLAN
from tpzoo.models.kv_cache import KVCache
from tpzoo.models.mlp import MLP_PLAN
from tpzoo.sharding_plan import prefixed

RESIDUALS = ("pre", "post", "parallel")
LAYER_PLAN = {"attention_norm": "norm", "mlp_norm": "norm", **prefixed("self_attention", ATTENTION_PLAN),
              **prefixed("mlp", MLP_PLAN)}


class TransformerLayer(nn.Module):
    """One block: [b, s, h] -> [b, s, h]. ``self_attention`` takes (x, mask, cache); ``mlp`` takes x.
    ``residual``: "pre", "post" or "parallel" (module docstring); ``dropout``: on each branch's output."""

    def __init__(self, self_attention: nn.Module, mlp: nn.Module, attention_norm: nn.Module, mlp_norm: nn.Module, *,
                 dropout: float = 0.0, residual: str = "pre") -> None:
        super().__init__()
        if residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {', '.join(RESIDUALS)}, got {residual!r}")
        self.residual = residual
        self.attention_norm = attention_norm
        self.self_attention = self_attention
        self.mlp_norm = mlp_norm
        self.mlp = mlp
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        if self.residual == "pre":
            x = x + self.dropout(self.self_attention(self.attention_norm(x), mask, cache))
            return x + self.dropout(self.mlp(self.mlp_norm(x)))
        if self.residual == "post":
            x = self.attention_norm(x + self.dropout(self.self_attention(x, mask, cache)))
            return self.mlp_norm(x + self.dropout(self.mlp(x)))
        attention = self.dropout(self.self_attention(self.attention_norm(x), mask, cache))
        return x + attention + self.dropout(self.mlp(self.mlp_norm(x)))

    def extra_repr(self) -> str:
        return f"residual={self.residual!r}"
