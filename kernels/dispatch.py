"""Backend choice for ``tpzoo.kernels``: environment ``TPZOO_KERNELS=auto|triton|torch``.

auto (the default) runs the Triton kernels on CUDA tensors when triton is installed and the
plain-torch references otherwise. The Triton modules are imported only when first used. Triton
on CPU tensors runs Triton's interpreter, which must be chosen before any ``@triton.jit``
decorator runs: with no CUDA device and TRITON_INTERPRET unset, the first such call sets
TRITON_INTERPRET=1 for this process (it then applies to every Triton kernel defined later).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "torch")


def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend_for(x: torch.Tensor) -> str:
    """"triton" or "torch": the backend that runs an op on ``x`` under the current TPZOO_KERNELS."""
    choice = os.environ.get("TPZOO_KERNELS", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"TPZOO_KERNELS={choice!r} is not a backend; use one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return "triton" if x.is_cuda and _have_triton() else "torch"
    return choice


def _interpret_on_cpu() -> None:
    if "TRITON_INTERPRET" in os.environ:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "TPZOO_KERNELS=triton on CPU tensors runs Triton's interpreter: on a machine with CUDA, set "
            "TRITON_INTERPRET=1 before the first kernel call (or move the tensors to the GPU)"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def triton_kernels(x: torch.Tensor, name: str) -> ModuleType | None:
    """The Triton kernel module ``name`` (softmax, norms, activations) to run on ``x``, or None for torch.

    Empty tensors always take the torch path (there is nothing to launch).
    """
    if backend_for(x) == "torch" or x.numel() == 0:
        return None
    if not _have_triton():
        raise ImportError("TPZOO_KERNELS=triton needs the triton package: pip install triton")
    if x.device.type == "cpu":
        _interpret_on_cpu()
    return importlib.import_module(f"{__package__}.{name}")
