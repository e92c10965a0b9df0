"""The kernels as modules: what ``tpzoo.parallel.parallelize`` puts in place of torch's own.

    LayerNorm   nn.LayerNorm over the last dim, through ``layer_norm``   (weight, bias)
    RMSNorm     nn.RMSNorm over the last dim, through ``rms_norm``       (weight)
    GELU        nn.GELU, through ``gelu``

``from_torch`` makes one from torch's module holding the very same parameters (not copies), so
state-dict names and values stay as they were. ``kernels``: the backend each op is called with
(auto | triton | torch; None reads TPZOO_KERNELS), set by whoever applies the run options.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops import gelu, layer_norm, rms_norm


class LayerNorm(nn.Module):
    """LayerNorm [..., h] -> [..., h], float32 math inside; ``bias`` may be absent."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, eps: float, kernels: str | None = None) -> None:
        super().__init__()
        self.weight, self.bias, self.eps, self.kernels = weight, bias, eps, kernels

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, backend=self.kernels)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}, kernels={self.kernels}"


class RMSNorm(nn.Module):
    """RMSNorm [..., h] -> [..., h], float32 math inside."""

    def __init__(self, weight: nn.Parameter, eps: float, kernels: str | None = None) -> None:
        super().__init__()
        self.weight, self.eps, self.kernels = weight, eps, kernels

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, backend=self.kernels)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, kernels={self.kernels}"


class GELU(nn.Module):
    """GELU elementwise, approximate "none" (erf) or "tanh"."""

    def __init__(self, approximate: str = "none", kernels: str | None = None) -> None:
        super().__init__()
        self.approximate, self.kernels = approximate, kernels

    def forward(self, x: Tensor) -> Tensor:
        return gelu(x, self.approximate, backend=self.kernels)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, kernels={self.kernels}"


def from_torch(module: nn.Module, kernels: str | None) -> nn.Module | None:
    """The kernel module standing for torch's ``module`` (sharing its parameters), or None when there is none:
    LayerNorm and RMSNorm with a weight over one last dim, and GELU."""
    if isinstance(module, nn.GELU):
        return GELU(module.approximate, kernels)
    if not isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or len(module.normalized_shape) != 1 or module.weight is None:
        return None
    if isinstance(module, nn.LayerNorm):
        return LayerNorm(module.weight, module.bias, module.eps, kernels)
    eps = module.eps if module.eps is not None else torch.finfo(module.weight.dtype).eps  # nn.RMSNorm's default
    return RMSNorm(module.weight, eps, kernels)
