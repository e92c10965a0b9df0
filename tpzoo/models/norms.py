"""Normalization blocks over the last dim, through ``tpzoo.kernels`` (Triton on CUDA, torch elsewhere).

    LayerNorm:  y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias     weight 1, bias 0 at init
    RMSNorm:    y = x / sqrt(mean(x^2) + eps) * weight                      weight 1 at init

Both keep their parameters replicated on the tp ranks. With ``sequence_parallel`` they normalize
a sequence shard [b, s/tp, h], so each rank's parameter gradient is a partial sum over its shard:
the norm marks its own parameters ``tp_partial`` (``tpzoo.parallel.param_facts``) for
``sync_sequence_parallel_grads``, from the plan it is handed: a model author never has to.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tpzoo import kernels as K
from tpzoo.parallel.param_facts import mark

NORMS = ("layernorm", "rmsnorm")


class _Norm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool, kernels: str | None,
                 bias: bool) -> None:
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        self.sequence_parallel = sequence_parallel
        for p in self.parameters():
            mark(p, tp_partial=sequence_parallel)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class LayerNorm(_Norm):
    """LayerNorm [..., h] -> [..., h] (``tpzoo.kernels.layer_norm``)."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool = False,
                 kernels: str | None = None) -> None:
        super().__init__(hidden_size, eps, sequence_parallel, kernels, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return K.layer_norm(x, self.weight, self.bias, self.eps, backend=self.kernels)


class RMSNorm(_Norm):
    """RMSNorm [..., h] -> [..., h] (``tpzoo.kernels.rms_norm``), float32 math inside."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool = False,
                 kernels: str | None = None) -> None:
        super().__init__(hidden_size, eps, sequence_parallel, kernels, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return K.rms_norm(x, self.weight, self.eps, backend=self.kernels)


def build_norm(kind: str, hidden_size: int, eps: float, sequence_parallel: bool = False,
               kernels: str | None = None) -> LayerNorm | RMSNorm:
    """``LayerNorm`` or ``RMSNorm`` by ``kind`` (one of ``NORMS``)."""
    if kind not in NORMS:
        raise ValueError(f"norm kind must be one of {', '.join(NORMS)}, got {kind!r}")
    return (LayerNorm if kind == "layernorm" else RMSNorm)(hidden_size, eps, sequence_parallel, kernels)
