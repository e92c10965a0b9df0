"""The transformer MLP, Y = act(X A) B, split Megatron's way (Shoeybi et al. 2019, sec. 3).

    A = [A_1 ... A_p]    column-parallel, [f/p, h] per rank: rank r computes act(X A_r + a_r)
    B = [B_1; ...; B_p]  row-parallel,    [h, f/p] per rank: Y = sum_r act(X A_r + a_r) B_r

The activation is elementwise, so it applies to each rank's f/p features with no communication
between the two matrix multiplies. GELU: with the Triton kernels the bias add and GELU run as one
fused kernel (``bias_gelu``); with the torch ones the bias goes into the matrix multiply instead.

Gated activations (Shazeer 2020): act(X A) = a(X G) * (X U), SwiGLU with a = SiLU, GeGLU with
a = GELU. G and U are one column-parallel weight A of [2f, h] whose rows interleave them,
[g_0 u_0 g_1 u_1 ...], so a contiguous 1/p of the rows holds the matching features of both and the
full weight is the same at every tp (Hugging Face's gate_proj and up_proj: ``tpzoo.convert``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo import kernels as K
from tpzoo.models import fused
from tpzoo.parallel import ColumnParallelLinear, ParallelPlan, RowParallelLinear, init_method_normal

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "geglu")
GATES = {"swiglu": F.silu, "geglu": F.gelu}


class ParallelMLP(nn.Module):
    """[b, s, h] -> ([b, s, h] before the output bias, the output bias [h] or None).

    ``activation``: one of ``ACTIVATIONS``; ``bias``: biases on both linears. With
    ``plan.sequence_parallel`` input and output are [b, s/tp, h] (the first linear all-gathers the
    sequence, the second reduce-scatters it).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, plan: ParallelPlan, *, activation: str = "gelu",
                 bias: bool = True, init_std: float = 0.02, output_init_std: float = 0.02) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        if ffn_hidden_size % plan.tp_size:
            raise ValueError(f"ffn_hidden_size={ffn_hidden_size} is not divisible by the tensor-parallel size "
                             f"tp={plan.tp_size}; choose ffn_hidden_size a multiple of {plan.tp_size} or another tp")
        self.activation, self.kernels = activation, plan.kernels
        self.gated = activation in GATES
        sp, tp_group = plan.sequence_parallel, plan.mesh.tp_group
        self.fuse_bias = bias and not self.gated and fused.runs_triton(plan.kernels, plan.mesh.device)
        self.dense_h_to_4h = ColumnParallelLinear(
            hidden_size, ffn_hidden_size * (2 if self.gated else 1), bias=bias,
            init_method=init_method_normal(init_std), skip_bias_add=self.fuse_bias, sequence_parallel=sp,
            tp_group=tp_group)
        self.dense_4h_to_h = RowParallelLinear(
            ffn_hidden_size, hidden_size, bias=bias, init_method=init_method_normal(output_init_std),
            skip_bias_add=True, sequence_parallel=sp, tp_group=tp_group)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.gated:
            y = self.dense_h_to_4h(x)                                              # [b, s, 2f/tp]
            gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)                         # [b, s, f/tp] each
            y = GATES[self.activation](gate) * up
        elif self.fuse_bias:
            y, bias = self.dense_h_to_4h(x)                                        # [b, s, f/tp], [f/tp]
            y = K.bias_gelu(y, bias, fused.gelu_approximate(self.activation), backend=self.kernels)
        else:
            y = K.bias_gelu(self.dense_h_to_4h(x), None, fused.gelu_approximate(self.activation),
                            backend=self.kernels)
        return self.dense_4h_to_h(y)                                               # [b, s, h], [h] or None
