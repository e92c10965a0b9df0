"""The ``tpzoo.kernels`` ops the models call, with the backend a config chooses.

``backend`` is TransformerConfig.kernels: "auto" | "triton" | "torch", or None to let the
kernels read TPZOO_KERNELS. It goes to the kernels' ``backend=`` keyword; while a kernels build
lacks that keyword, TPZOO_KERNELS is set around the call instead (the backward pass runs the
kernels that the forward chose, so only the forward needs it).
"""

from __future__ import annotations

import functools
import inspect
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from tpzoo import kernels


@functools.cache
def _takes_backend(fn: Callable) -> bool:
    return "backend" in inspect.signature(fn).parameters


@contextmanager
def _kernels_env(backend: str) -> Iterator[None]:
    old = os.environ.get("TPZOO_KERNELS")
    os.environ["TPZOO_KERNELS"] = backend
    try:
        yield
    finally:
        if old is None:
            del os.environ["TPZOO_KERNELS"]
        else:
            os.environ["TPZOO_KERNELS"] = old


def _call(name: str, *args: Any, backend: str | None) -> Tensor:
    fn = getattr(kernels, name)
    if backend is None:
        return fn(*args)
    if _takes_backend(fn):
        return fn(*args, backend=backend)
    with _kernels_env(backend):
        return fn(*args)


def runs_triton(backend: str | None, device: torch.device) -> bool:
    """Whether the kernels run Triton for tensors on ``device``: the contract's rule, auto = Triton
    on CUDA tensors and torch elsewhere; None reads TPZOO_KERNELS."""
    choice = backend or os.environ.get("TPZOO_KERNELS", "auto")
    return choice == "triton" or (choice == "auto" and device.type == "cuda")


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, backend: str | None) -> Tensor:
    """LayerNorm over the last dim of x [..., h]; weight, bias [h]."""
    return _call("layer_norm", x, weight, bias, eps, backend=backend)


def bias_gelu(x: Tensor, bias: Tensor | None, approximate: str, backend: str | None) -> Tensor:
    """GELU(x + bias), bias [h] over x [..., h]; approximate "none" (erf) or "tanh"."""
    return _call("bias_gelu", x, bias, approximate, backend=backend)


def scaled_masked_softmax(x: Tensor, mask: Tensor | None, scale: float, backend: str | None) -> Tensor:
    """softmax(scale * x) over scores [b, n, sq, sk]; mask bool broadcastable to x, True = masked out."""
    return _call("scaled_masked_softmax", x, mask, scale, backend=backend)


def scaled_causal_softmax(x: Tensor, scale: float, backend: str | None) -> Tensor:
    """softmax(scale * x) over scores [b, n, s, s] with the causal mask."""
    return _call("scaled_causal_softmax", x, scale, backend=backend)


def gelu_approximate(activation: str) -> str:
    """TransformerConfig.activation -> the ``approximate`` argument of GELU."""
    return "tanh" if activation == "gelu_tanh" else "none"
