"""Rotary position embeddings (Su et al. 2021), in the half-rotation layout of Hugging Face and Megatron-LM.

For a head of d features and position t, the pairs (x_i, x_{i + d/2}) turn by angle t theta_i,
theta_i = base^(-2i/d):

    rope(x)_t = x_t cos(t theta) + rotate_half(x_t) sin(t theta),  rotate_half([x1, x2]) = [-x2, x1]

(cos and sin of [theta, theta] over the d features). Keys and queries of every head turn alike,
so nothing depends on tp: each rank rotates its own heads. The original Llama checkpoints pair
features (x_{2i}, x_{2i+1}) instead; Hugging Face's weights, which ``tpzoo.convert`` reads, already
use this layout, so their q and k projections map unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos / sin tables [P, d] (float32, not saved) for positions 0 .. ``max_positions`` - 1."""

    def __init__(self, head_dim: int, base: float, max_positions: int) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings turn pairs of features: head_dim={head_dim} must be even")
        self.head_dim, self.base, self.max_positions = head_dim, base, max_positions
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, d/2]
        angles = torch.cat((angles, angles), dim=-1)                                      # [P, d]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        """Rotate q [b, n, s, d] and k [b, g, s, d] at positions offset .. offset + s - 1."""
        s = q.shape[2]
        if offset + s > self.max_positions:
            raise ValueError(f"sequence length {offset + s} exceeds max_position_embeddings={self.max_positions}")
        cos, sin = self.cos[offset:offset + s].to(q.dtype), self.sin[offset:offset + s].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}, max_positions={self.max_positions}"
