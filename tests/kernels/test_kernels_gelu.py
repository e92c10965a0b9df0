"""gelu and bias_gelu (erf and tanh forms) against a float64 oracle, both backends."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPES, check, padded_rows, transposed_layout

from tpzoo import kernels as K

pytestmark = pytest.mark.tier("unit")




def gelu_oracle(z: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))


# 70x37: two partial-sum groups of 64-row tiles with one block; 2x3x37: bias over a 3-D input.
SHAPES = {"5x37": (5, 37), "flat-1000": (1000,), "70x37": (70, 37), "2x3x37": (2, 3, 37), "4x1": (4, 1)}
# the block caps each shape runs under (``max_block``, indirect): the looped path (a cap of 16) on the shapes of a
# few rows, where the interpreter runs it in seconds; the large ones add nothing to it but rows
BLOCKS = [pytest.param(cap, shape, id=f"{'looped' if cap else 'one-block'}-{shape}") for shape in SHAPES
          for cap in ((None,) if shape in ("flat-1000", "70x37") else (None, 16))]


@pytest.mark.tier("distributed")
@pytest.mark.parametrize("max_block, shape", BLOCKS, indirect=["max_block"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_matches_float64(backend, max_block, approximate, shape, dtype):
    x = (torch.randn(SHAPES[shape]) * 3).to(dtype)
    check(f"gelu-{approximate}", lambda x: K.gelu(x, approximate), lambda x: gelu_oracle(x, approximate),
          lambda x: F.gelu(x, approximate=approximate), [x])


def check_bias_gelu(x: torch.Tensor, approximate: str, dy_layout=lambda t: t) -> None:
    b = torch.randn(x.shape[-1]).to(x.dtype)
    check(f"bias_gelu-{approximate}", lambda x, b: K.bias_gelu(x, b, approximate),
          lambda x, b: gelu_oracle(x + b, approximate), lambda x, b: F.gelu(x + b, approximate=approximate),
          [x, b], dy_layout=dy_layout)


@pytest.mark.parametrize("max_block, shape", BLOCKS, indirect=["max_block"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_gelu_matches_float64(backend, max_block, approximate, shape, dtype):
    check_bias_gelu((torch.randn(SHAPES[shape]) * 3).to(dtype), approximate)


@pytest.mark.parametrize("layout", [transposed_layout, padded_rows], ids=["last-dim-strided", "padded-rows"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_non_contiguous(backend, approximate, layout):
    check_bias_gelu(layout(torch.randn(6, 5, 24) * 3), approximate, dy_layout=layout)
