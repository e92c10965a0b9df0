"""gelu and bias_gelu (erf and tanh forms) against a float64 oracle, both backends."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES
from kernel_checks import check, padded_rows, transposed_layout

from tpzoo import kernels as K


def gelu_oracle(z: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))


SHAPES = {"5x37": (5, 37), "flat-1000": (1000,), "100x37": (100, 37), "2x3x5x37": (2, 3, 5, 37), "4x1": (4, 1)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_matches_float64(backend, max_block, approximate, shape, dtype):
    x = (torch.randn(SHAPES[shape]) * 3).to(dtype)
    check(f"gelu-{approximate}", lambda x: K.gelu(x, approximate), lambda x: gelu_oracle(x, approximate),
          lambda x: F.gelu(x, approximate=approximate), [x])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_gelu_matches_float64(backend, max_block, approximate, shape, dtype):
    x = (torch.randn(SHAPES[shape]) * 3).to(dtype)
    b = torch.randn(x.shape[-1]).to(dtype)
    check(f"bias_gelu-{approximate}", lambda x, b: K.bias_gelu(x, b, approximate), lambda x, b: gelu_oracle(x + b, approximate),
          lambda x, b: F.gelu(x + b, approximate=approximate), [x, b])


@pytest.mark.parametrize("layout", [transposed_layout, padded_rows], ids=["last-dim-strided", "padded-rows"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_non_contiguous(backend, approximate, layout):
    x = layout(torch.randn(6, 5, 24) * 3)
    b = torch.randn(24)
    check(f"bias_gelu-{approximate}", lambda x, b: K.bias_gelu(x, b, approximate), lambda x, b: gelu_oracle(x + b, approximate),
          lambda x, b: F.gelu(x + b, approximate=approximate), [x, b], dy_layout=layout)
