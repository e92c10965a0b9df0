"""One grouped matrix multiply for a mixture of experts' experts (``--moe-grouped-gemm``): the rows of each expert
times that expert's weight, every expert in one call of ``torch._grouped_mm`` (CUTLASS grouped GEMM on Hopper GPUs,
a loop inside torch elsewhere), the rows' split given by a device tensor, so that nothing is read on the host.

    Y = grouped_mm(X, W, ends)      X [R, a], W [N, b, a], ends [N] int32 -> Y [R, b]
                                    Y[ends[e-1]:ends[e]] = X[ends[e-1]:ends[e]] W_e^T   (ends[-1] = R)

Its backward, by grouped multiplies too: dX = dY W (per expert), dW_e = dY_e^T X_e ([N, b, a], 0 for an expert
without rows). torch 2.13's own backward of ``torch._grouped_mm`` fails on the CPU ("Invalid strides/sizes"),
measured; its three forward forms work there, so this Function runs on every device.

torch._grouped_mm wants every row stride a multiple of 16 bytes: a and b multiples of 8 features in bfloat16, of 4 in
float32 (``check_grouped_sizes``).
"""

from __future__ import annotations

import torch
from torch import Tensor

ALIGNMENT_BYTES = 16


def check_grouped_sizes(dtype: torch.dtype, **features: int) -> None:
    """ValueError naming the sizes whose rows of ``dtype`` are no multiple of 16 bytes (torch._grouped_mm's rule)."""
    size = dtype.itemsize
    wrong = {name: n for name, n in features.items() if n * size % ALIGNMENT_BYTES}
    if wrong:
        sizes = ", ".join(f"{name} {n}" for name, n in wrong.items())
        raise ValueError(f"--moe-grouped-gemm: {sizes} features of {dtype} are no multiple of {ALIGNMENT_BYTES} bytes "
                         f"(torch._grouped_mm's row alignment: a multiple of {ALIGNMENT_BYTES // size} features per "
                         f"rank); choose such sizes or drop --moe-grouped-gemm")


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
        ctx.save_for_backward(x, w, ends)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w, ends = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch._grouped_mm(grad, w, offs=ends) if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(grad.t(), x, offs=ends) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """X [R, a] by expert rows times W [N, b, a] transposed -> [R, b] (module docstring); ``ends`` [N] int32, on x's
    device: the cumulative row counts."""
    return _GroupedMM.apply(x, w, ends)
