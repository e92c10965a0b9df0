"""Backend choice for ``tpzoo.kernels``: environment ``TPZOO_KERNELS=auto|triton|torch``.

auto (the default) runs the Triton kernels on CUDA tensors when triton is installed and the
plain-torch references otherwise. The Triton modules are imported only when first used. Triton
on CPU tensors runs Triton's interpreter, which must be chosen before triton.language is first
imported: with no CUDA device and TRITON_INTERPRET unset, the first such call sets
TRITON_INTERPRET=1 for this process (it then applies to every Triton kernel defined later).
If triton was already imported without it (torch.compile imports triton), the call raises.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "torch")


_HAVE_TRITON = importlib.util.find_spec("triton") is not None  # a constant torch.compile can trace


def backend_for(device: torch.device, backend: str | None = None) -> str:
    """"triton" or "torch": the backend that runs an op on tensors on ``device``; None reads TPZOO_KERNELS."""
    choice = backend if backend is not None else os.environ.get("TPZOO_KERNELS", "auto")
    if choice not in BACKENDS:
        source = "backend" if backend is not None else "TPZOO_KERNELS"
        raise ValueError(f"{source}={choice!r} is not a backend; use one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and _HAVE_TRITON else "torch"
    return choice


def _use_interpreter() -> None:
    """Triton on CPU tensors runs its interpreter, which must be on before triton.language is imported."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    on = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
    lang = sys.modules.get("triton.language")
    if lang is not None:  # imported before: its library functions must be the interpreter's
        from triton.runtime.jit import JITFunction

        on = on and not any(isinstance(getattr(lang, f, None), JITFunction) for f in ("sum", "max", "zeros"))
    if not on:
        raise RuntimeError(
            "TPZOO_KERNELS=triton on CPU tensors runs Triton's interpreter, which needs TRITON_INTERPRET=1 in the "
            "environment before triton is first imported (torch.compile imports it): set it before starting "
            "Python, or use TPZOO_KERNELS=auto|torch, or move the tensors to the GPU"
        )


def use_triton(x: torch.Tensor, backend: str | None = None) -> bool:
    """Whether an op on ``x`` runs a Triton kernel: the backend is triton and x is not empty.

    Plain Python over the environment and x's device, so torch.compile traces it (fullgraph).
    On CPU tensors it turns Triton's interpreter on (see the module docstring) when run eagerly.
    """
    if backend_for(x.device, backend) == "torch" or x.numel() == 0:
        return False
    if not _HAVE_TRITON:
        raise ImportError("TPZOO_KERNELS=triton needs the triton package: pip install triton")
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        _use_interpreter()  # now: an op's first call imports torch._dynamo, which imports triton
    return True


def kernel_module(name: str, device: torch.device) -> ModuleType:
    """The Triton kernel module ``name`` (softmax, norms, activations, ...) to run on ``device``.

    Imported on first use; on CPU tensors after checking that Triton's interpreter is on.
    """
    if device.type == "cpu":
        _use_interpreter()
    return importlib.import_module(f"{__package__}.{name}")

