"""The norms, by the name Megatron-LM's --normalization gives them: torch's own modules.

    LayerNorm:  y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias     weight 1, bias 0 at init
    RMSNorm:    y = x / sqrt(mean(x^2) + eps) * weight                      weight 1 at init

``tpzoo.parallel.parallelize`` puts ``tpzoo.kernels``' LayerNorm and RMSNorm in their place (the same
parameters; Triton on CUDA, float32 math inside).
"""

from __future__ import annotations

from torch import nn

from tpzoo.models.config import NORMALIZATIONS


def norm(kind: str, hidden_size: int, eps: float) -> nn.LayerNorm | nn.RMSNorm:
    """nn.LayerNorm or nn.RMSNorm over the last dim of ``hidden_size``, by ``kind`` (one of ``NORMALIZATIONS``)."""
    if kind not in NORMALIZATIONS:
        raise ValueError(f"norm kind must be one of {', '.join(NORMALIZATIONS)}, got {kind!r}")
    return nn.LayerNorm(hidden_size, eps=eps) if kind == "LayerNorm" else nn.RMSNorm(hidden_size, eps=eps)
