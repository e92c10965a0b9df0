"""Rotary position embeddings (Su et al. 2021), in the half-rotation layout of Hugging Face and Megatron-LM.

For the first r features of a head (r = d, or a fraction of it: GPT-NeoX's partial rotary) and
position t, the pairs (x_i, x_{i + r/2}) turn by angle t theta_i, theta_i = base^(-2i/r):

    rope(x)_t = x_t cos(t theta) + rotate_half(x_t) sin(t theta),  rotate_half([x1, x2]) = [-x2, x1]

(cos and sin of [theta, theta] over the r features); the other d - r features pass unchanged. Keys
and queries of every head turn alike, so tensor parallelism changes nothing: each rank rotates its
own heads. The original Llama checkpoints pair features (x_{2i}, x_{2i+1}) instead; Hugging Face's
weights, which ``tpzoo.convert`` reads, already use this layout.

Llama 3.x stretches the context by slowing the low frequencies (``Llama3Scaling``, Hugging Face's
``rope_type: llama3``): with wavelength lambda_i = 2 pi / theta_i and the original context L,

    theta_i / factor                 where lambda_i > L / low_freq_factor
    theta_i                          where lambda_i < L / high_freq_factor
    (1 - a) theta_i / factor + a theta_i   between,  a = (L / lambda_i - low) / (high - low)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.x's rotary frequencies (module docstring); the defaults are Llama 3.1's."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __call__(self, inv_freq: Tensor) -> Tensor:
        wavelength = 2 * math.pi / inv_freq
        slow = self.original_max_positions / self.low_freq_factor    # wavelengths above: divided by factor
        fast = self.original_max_positions / self.high_freq_factor   # wavelengths below: kept
        scaled = torch.where(wavelength > slow, inv_freq / self.factor, inv_freq)
        a = (self.original_max_positions / wavelength - self.low_freq_factor) / (self.high_freq_factor -
                                                                                  self.low_freq_factor)
        blended = (1 - a) * scaled / self.factor + a * scaled
        return torch.where((wavelength >= fast) & (wavelength <= slow), blended, scaled)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos / sin tables [P, r] (float32, not saved) for positions 0 .. ``max_positions`` - 1, turning the first
    r = ``fraction`` x head_dim features of each head (r even); ``scaling`` changes the frequencies
    (``Llama3Scaling``)."""

    def __init__(self, head_dim: int, base: float, max_positions: int, fraction: float = 1.0,
                 scaling: Llama3Scaling | None = None) -> None:
        super().__init__()
        rotated = int(head_dim * fraction)
        if not 0 < fraction <= 1 or rotated < 2 or rotated % 2:
            raise ValueError(f"rotary embeddings turn pairs of features: head_dim={head_dim} x fraction={fraction} "
                             f"= {head_dim * fraction:g} must be an even number of features >= 2")
        self.head_dim, self.rotated, self.base, self.max_positions = head_dim, rotated, base, max_positions
        inv_freq = 1.0 / (base ** (torch.arange(0, rotated, 2, dtype=torch.int64).float() / rotated))
        if scaling is not None:
            inv_freq = scaling(inv_freq)
        self.scaling = scaling
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, r/2]
        angles = torch.cat((angles, angles), dim=-1)                                      # [P, r]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, q: Tensor, k: Tensor, offset: int = 0, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Rotate q [b, n, s, d] and k [b, g, s, d] at positions offset .. offset + s - 1, or at ``positions`` ([s] or
        [b, s]: each token's own, e.g. the pieces of a sequence context parallelism holds)."""
        s = q.shape[2]
        if positions is None:
            if offset + s > self.max_positions:
                raise ValueError(f"sequence length {offset + s} exceeds max_position_embeddings={self.max_positions}")
            cos, sin = self.cos[offset:offset + s], self.sin[offset:offset + s]
        else:
            if positions.shape[-1] != s:
                raise ValueError(f"positions {tuple(positions.shape)} do not match the {s} tokens of q")
            cos, sin = self.cos[positions], self.sin[positions]               # [s, r] or [b, s, r]
            if positions.dim() == 2:
                cos, sin = cos[:, None], sin[:, None]                         # [b, 1, s, r]
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return self._turn(q, cos, sin), self._turn(k, cos, sin)

    def _turn(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.rotated == self.head_dim:
            return x * cos + rotate_half(x) * sin
        turned, kept = x[..., :self.rotated], x[..., self.rotated:]
        return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotated={self.rotated}, base={self.base:g}, "
                f"max_positions={self.max_positions}, scaling={self.scaling}")
