"""Launch helpers shared by the Triton kernels: block sizes, warps, partial-sum groups, buffers.

Imported only with the kernel modules (lazily, see ``dispatch``). Tests lower ``MAX_BLOCK`` so
that the looped paths for rows longer than one block run on small CPU shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Most elements one program holds in registers along a row. Longer rows take the looped paths.
MAX_BLOCK = 8192
# Elements per program of a 2-D tile, at most: the elementwise (GELU) tiles, and several short
# rows of softmax and norms at once (a 1024-wide bf16 row alone is 2 KB: too little per program).
MAX_TILE = 4096


def row_block(n: int) -> tuple[int, bool]:
    """(BLOCK, LOOPED) for a row of n elements: next power of two capped at MAX_BLOCK."""
    block = min(triton.next_power_of_2(max(n, 1)), MAX_BLOCK)
    return block, block < n


def row_tile(rows: int, n: int) -> tuple[int, int, bool]:
    """(ROWS, BLOCK, LOOPED) for ``rows`` rows of n elements: BLOCK, LOOPED as in ``row_block``, and
    ROWS rows per tile, a power of two with ROWS x BLOCK <= MAX_TILE (1 for rows longer than that)."""
    block, looped = row_block(n)
    cap = min(MAX_TILE, MAX_BLOCK)
    return (1 if looped else max(1, min(triton.next_power_of_2(max(rows, 1)), cap // block))), block, looped


def tile(rows: int, cols: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a 2-D elementwise tile over [rows, cols], at most MAX_TILE elements."""
    cap = min(MAX_TILE, MAX_BLOCK)
    block_n = min(triton.next_power_of_2(max(cols, 1)), 1024, cap)
    block_m = min(triton.next_power_of_2(max(rows, 1)), max(1, cap // block_n))
    return block_m, block_n


def num_warps(block: int) -> int:
    """Warps for a program of ``block`` elements (4 up to 2048 elements, 8 up to 4096, then 16)."""
    return 4 if block <= 2048 else 8 if block <= 4096 else 16


def partial_groups(device: torch.device, rows: int, multiple: int = 1) -> tuple[int, int]:
    """(groups, rows_per_group) for per-program partial sums over ``rows``.

    Two groups per SM on CUDA, 4 elsewhere (the interpreter), never more than needed;
    rows_per_group is a multiple of ``multiple`` so that row tiles never straddle two groups.
    The SM count is queried only for CUDA devices, so the interpreter path never asks a GPU.
    """
    groups = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    per_group = triton.cdiv(triton.cdiv(rows, groups), multiple) * multiple
    return triton.cdiv(rows, per_group), per_group


def new_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes is allocated here (tests poison it to prove every element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim has stride 1 (the kernels' only layout requirement), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x viewed as [rows, x.shape[-1]] with unit stride along the row (copied only when needed)."""
    return unit_last_stride(x.reshape(-1, x.shape[-1]))


@triton.jit
def store(ptr, value, mask):
    """Store float32 ``value`` in ptr's dtype, rounding to nearest even.

    Triton's interpreter truncates float32 to bfloat16; rounding the bits first makes the cast
    exact there, and costs a few integer ops on a GPU (where the cast would round anyway).
    """
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        value = bits.to(tl.float32, bitcast=True)
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)
