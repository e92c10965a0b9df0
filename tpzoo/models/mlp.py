"""The transformer MLP, Y = act(X A) B: plain PyTorch, split Megatron's way by its plan (``MLP_PLAN``).

    A = [A_1 ... A_p]    column-parallel, [f/p, h] per rank: rank r computes act(X A_r + a_r)
    B = [B_1; ...; B_p]  row-parallel,    [h, f/p] per rank: Y = sum_r act(X A_r + a_r) B_r

The activation is elementwise, so it applies to each rank's f/p features with no communication
between the two matrix multiplies. Gated activations (Shazeer 2020): act(X A) = a(X G) * (X U), SwiGLU
with a = SiLU, GeGLU with a = GELU. G and U are one weight A of [2f, h] whose rows interleave them,
[g_0 u_0 g_1 u_1 ...], so a contiguous 1/p of the rows holds the matching features of both and the
full weight is the same at every tp (Hugging Face's gate_proj and up_proj: ``tpzoo.convert``).
"""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo.models.config import ACTIVATIONS
from tpzoo.models.weights import linear

GATES = {"swiglu": F.silu, "geglu": F.gelu}
MLP_PLAN = {"dense_h_to_4h": "column", "dense_4h_to_h": "row"}


def gelu_approximation(activation: str) -> str:
    """The ``approximate`` of torch's GELU for activation "gelu" (erf: "none") or "gelu_tanh" ("tanh")."""
    return "tanh" if activation == "gelu_tanh" else "none"


def activation_of(activation: str) -> tuple[Callable[[Tensor], Tensor] | None, nn.Module | None]:
    """(gate, None) for a gated ``activation`` (one of ``ACTIVATIONS``), else (None, its GELU module)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    gate = GATES.get(activation)
    return gate, None if gate else nn.GELU(approximate=gelu_approximation(activation))


def activate(y: Tensor, gate: Callable[[Tensor], Tensor] | None, activation: nn.Module | None) -> Tensor:
    """act(X A) of the first linear's output ``y`` [..., f] (gated: [..., 2f], gate and up rows interleaved)."""
    if gate is None:
        return activation(y)
    g, up = y.unflatten(-1, (-1, 2)).unbind(-1)
    return gate(g) * up


class MLP(nn.Module):
    """[b, s, h] -> [b, s, h]. ``activation``: one of ``ACTIVATIONS``; ``bias``: biases on both linears;
    weights ~ N(0, ``init_std``^2), the second linear's ``out_init_std``."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: str = "gelu", bias: bool = True,
                 init_std: float = 0.02, out_init_std: float = 0.02) -> None:
        super().__init__()
        self.gate, activation_module = activation_of(activation)
        self.ffn_hidden_size = ffn_hidden_size
        self.dense_h_to_4h = linear(hidden_size, ffn_hidden_size * (2 if self.gate else 1), bias, init_std)
        self.activation = activation_module
        self.dense_4h_to_h = linear(ffn_hidden_size, hidden_size, bias, out_init_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.dense_4h_to_h(activate(self.dense_h_to_4h(x), self.gate, self.activation))  # [b, s, f | 2f]
