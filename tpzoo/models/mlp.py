"""The transformer MLP, Y = GeLU(X A) B, split Megatron's way (Shoeybi et al. 2019, sec. 3).

    A = [A_1 ... A_p]    column-parallel, [f/p, h] per rank: rank r computes GeLU(X A_r + a_r)
    B = [B_1; ...; B_p]  row-parallel,    [h, f/p] per rank: Y = sum_r GeLU(X A_r + a_r) B_r

GeLU is elementwise, so it applies to each rank's f/p features with no communication between
the two matrix multiplies. With the Triton kernels the bias add and GeLU run as one fused kernel
(``bias_gelu``); with the torch ones the bias goes into the matrix multiply (addmm) instead.
"""

from __future__ import annotations

from torch import Tensor, nn

from tpzoo import kernels as K
from tpzoo.models import fused
from tpzoo.models.config import TransformerConfig
from tpzoo.parallel import ColumnParallelLinear, ParallelMesh, RowParallelLinear, init_method_normal


class ParallelMLP(nn.Module):
    """[b, s, h] -> ([b, s, h] before the output bias, the output bias [h]).

    With ``config.sequence_parallel`` input and output are [b, s/tp, h] (the first layer
    all-gathers the sequence, the second reduce-scatters it).
    """

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh) -> None:
        super().__init__()
        self.config = config
        self.approximate = fused.gelu_approximate(config.activation)
        sp = config.sequence_parallel
        self.fuse_bias = fused.runs_triton(config.kernels, mesh.device)
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, config.ffn_size, init_method=init_method_normal(config.init_method_std),
            skip_bias_add=self.fuse_bias, sequence_parallel=sp, tp_group=mesh.tp_group)
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_size, config.hidden_size, init_method=init_method_normal(config.output_init_std),
            skip_bias_add=True, sequence_parallel=sp, tp_group=mesh.tp_group)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.fuse_bias:
            y, bias = self.dense_h_to_4h(x)                                      # [b, s, f/tp], [f/tp]
            y = K.bias_gelu(y, bias, self.approximate, backend=self.config.kernels)
        else:
            y = K.bias_gelu(self.dense_h_to_4h(x), None, self.approximate, backend=self.config.kernels)
        return self.dense_4h_to_h(y)                                             # [b, s, h], [h]
