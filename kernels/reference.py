"""Plain-torch versions of the kernels with the same semantics: the ``torch`` backend.

Math in float32 (float64 stays float64), result in the input dtype. ``bench/kernel_speed.py`` times
these eagerly and under ``torch.compile`` against the Triton kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(scale * x) over the last dim, -inf where mask is True; fully masked rows give zeros."""
    s = x.to(_math_dtype(x)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    mx = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - mx.masked_fill(mx == float("-inf"), 0.0))
    total = e.sum(-1, keepdim=True)
    return (e / total.masked_fill(total == 0, 1.0)).to(x.dtype)


def causal_mask(sq: int, sk: int, device: torch.device | None = None) -> torch.Tensor:
    """[sq, sk] bool, True above the diagonal: query q sees keys k <= q + sk - sq."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


def scaled_causal_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """scaled_masked_softmax with the causal mask of x's last two dims."""
    return scaled_masked_softmax(x, causal_mask(x.shape[-2], x.shape[-1], x.device), scale)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim."""
    dt = _math_dtype(x)
    b = None if bias is None else bias.to(dt)
    return F.layer_norm(x.to(dt), x.shape[-1:], weight.to(dt), b, eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim."""
    xf = x.to(_math_dtype(x))
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)).to(x.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """GELU(x + bias), bias broadcast over the last dim (None: plain GELU)."""
    z = x.to(_math_dtype(x))
    if bias is not None:
        z = z + bias.to(z.dtype)
    return F.gelu(z, approximate=approximate).to(x.dtype)
