"""The public kernel API: argument checks, then the Triton kernels or the torch references.

Every op is differentiable; any floating dtype in, the same dtype out, float32 math inside.
Each op takes ``backend="auto"|"triton"|"torch"``; None (the default) reads TPZOO_KERNELS
(see ``dispatch``). The Triton path calls the ``torch.ops.tpzoo.*`` operators of ``library``;
the torch path is plain torch code (``reference``), which torch.compile compiles like any other.
"""

from __future__ import annotations

import torch

from . import library, reference
from .dispatch import use_triton

APPROXIMATIONS = ("none", "tanh")


def _check_float(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def _check_hidden(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """t must be a float vector of x's hidden size (last dim)."""
    _check_float(name, t, x)
    if t.shape != x.shape[-1:]:
        raise ValueError(f"{name} has shape {list(t.shape)} but x's hidden size (last dim) is {x.shape[-1]}")


def _check_scores(x: torch.Tensor) -> None:
    _check_float("x", x, x)
    if x.dim() != 4:
        raise ValueError(f"x must be attention scores [batch, heads, sq, sk], got shape {list(x.shape)}")


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float, *,
                          backend: str | None = None) -> torch.Tensor:
    """softmax(scale * x) over the last dim of scores x [batch, heads, sq, sk].

    mask: bool, True = masked out (Megatron's convention), broadcastable to x, e.g. a padding
    mask [b, 1, 1, sk] or a full mask [b, 1, sq, sk]; None for no mask. A row with every key
    masked gives zeros. Backward: dx = scale * y * (dy - sum(dy * y)).
    """
    _check_scores(x)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = masked out), got {getattr(mask, 'dtype', mask)}")
        if mask.device != x.device:
            raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
        if mask.dim() > 4 or any(m not in (1, n) for m, n in zip(reversed(mask.shape), reversed(x.shape))):
            raise ValueError(f"mask of shape {list(mask.shape)} does not broadcast to x of shape {list(x.shape)}")
    if not use_triton(x, backend):
        return reference.scaled_masked_softmax(x, mask, scale)
    return library.scaled_masked_softmax(x, mask, float(scale))


def scaled_causal_softmax(x: torch.Tensor, scale: float, *, backend: str | None = None) -> torch.Tensor:
    """softmax(scale * x) with a causal mask over scores x [batch, heads, sq, sk].

    Query q sees keys k <= q + sk - sq (the lower triangle when sq == sk); the Triton kernel
    never reads the keys above it. Backward as in ``scaled_masked_softmax``.
    """
    _check_scores(x)
    if not use_triton(x, backend):
        return reference.scaled_causal_softmax(x, scale)
    return library.scaled_causal_softmax(x, float(scale))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5, *,
               backend: str | None = None) -> torch.Tensor:
    """LayerNorm over the last dim: (x - mean) / sqrt(var + eps) * weight + bias.

    x: [..., hidden]; weight, bias: [hidden] (bias may be None), any float dtype.
    """
    _check_float("x", x, x)
    _check_hidden("weight", weight, x)
    if bias is not None:
        _check_hidden("bias", bias, x)
    if not use_triton(x, backend):
        return reference.layer_norm(x, weight, bias, eps)
    return library.layer_norm(x, weight, bias, float(eps))[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             backend: str | None = None) -> torch.Tensor:
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight; x [..., hidden], weight [hidden]."""
    _check_float("x", x, x)
    _check_hidden("weight", weight, x)
    if not use_triton(x, backend):
        return reference.rms_norm(x, weight, eps)
    return library.rms_norm(x, weight, float(eps))[0]


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none", *,
              backend: str | None = None) -> torch.Tensor:
    """GELU(x + bias), bias [hidden] broadcast over x [..., hidden] (None: plain GELU).

    approximate: "none" = x * Phi(x) with the erf (BERT), "tanh" = the tanh form (GPT-2).
    The backward recomputes from x and reduces the bias gradient in the same kernel.
    """
    _check_float("x", x, x)
    if bias is not None:
        _check_hidden("bias", bias, x)
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if not use_triton(x, backend):
        return reference.bias_gelu(x, bias, approximate)
    return library.bias_gelu(x, bias, approximate == "tanh")


def gelu(x: torch.Tensor, approximate: str = "none", *, backend: str | None = None) -> torch.Tensor:
    """GELU(x) elementwise, any shape; approximate "none" (erf) or "tanh"."""
    return bias_gelu(x, None, approximate, backend=backend)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                  ignore_index: int = -100, *, vocab_size: int | None = None,
                  backend: str | None = None) -> torch.Tensor:
    """Per-token ``F.cross_entropy(logits[..., :vocab_size], target, reduction="none", ...)``, fused.

    logits [..., V'] any float dtype (columns past ``vocab_size``, default V', are padding);
    target [...] int ids in [0, vocab_size) or ``ignore_index`` (loss 0 there). Returns float32
    (float64 for float64 logits). The gradient is written in the forward pass; the tp-sharded
    form is ``tpzoo.parallel.vocab_parallel_cross_entropy`` (docs/kernels.md).
    """
    from tpzoo.parallel.cross_entropy import cross_entropy as fused  # here: tpzoo.parallel imports tpzoo.kernels

    return fused(logits, target, label_smoothing, ignore_index, vocab_size=vocab_size, backend=backend)
