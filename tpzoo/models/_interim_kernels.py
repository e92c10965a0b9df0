"""INTERIM: plain-torch stand-ins for tpzoo.kernels until the kernels branch is merged (then deleted)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def bias_gelu(x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def scaled_masked_softmax(x: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    s = x * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0)


def scaled_causal_softmax(x: Tensor, scale: float) -> Tensor:
    mask = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
    return scaled_masked_softmax(x, mask, scale)
