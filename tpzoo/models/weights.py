"""torch's layers with Megatron-LM's initialisation, each weight drawn once.

torch's nn.Linear and nn.Embedding draw their weights as they are built (kaiming uniform, N(0, 1)).
tpzoo's models draw each weight once, N(0, std^2), biases 0, in the order a model builds them; so
these build the layer without drawing (on the meta device), then draw. A model piece built under
the same seed (``tpzoo.models.base.building``) then holds the same weights whoever builds it.
"""

from __future__ import annotations

import torch
from torch import nn


def _drawn(layer: nn.Linear | nn.Embedding, std: float) -> nn.Linear | nn.Embedding:
    layer = layer.to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.normal_(0.0, std)
        if getattr(layer, "bias", None) is not None:
            layer.bias.zero_()
    return layer


def linear(in_features: int, out_features: int, bias: bool = True, std: float = 0.02) -> nn.Linear:
    """nn.Linear, weight [out, in] ~ N(0, std^2), bias 0."""
    return _drawn(nn.Linear(in_features, out_features, bias=bias, device="meta"), std)


def embedding(num_embeddings: int, embedding_dim: int, std: float = 0.02) -> nn.Embedding:
    """nn.Embedding, weight [num, dim] ~ N(0, std^2)."""
    return _drawn(nn.Embedding(num_embeddings, embedding_dim, device="meta"), std)
