"""How the models choose among ``tpzoo.kernels``' paths.

``backend`` is TransformerConfig.kernels: "auto" | "triton" | "torch", or None to let the
kernels read TPZOO_KERNELS; the models pass it to each op's ``backend=`` keyword.
"""

from __future__ import annotations

import torch

from tpzoo.kernels.dispatch import backend_for


def runs_triton(backend: str | None, device: torch.device) -> bool:
    """Whether the kernels run Triton for tensors on ``device`` (auto: Triton on CUDA, torch elsewhere)."""
    return backend_for(device, backend) == "triton"


def gelu_approximate(activation: str) -> str:
    """TransformerConfig.activation -> the ``approximate`` argument of GELU."""
    return "tanh" if activation == "gelu_tanh" else "none"
