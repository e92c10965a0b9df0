"""layer_norm and rms_norm against a float64 oracle, both backends, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPES, check, padded_rows, transposed_layout

from tpzoo import kernels as K
from tpzoo.kernels import launch

pytestmark = pytest.mark.tier("unit")



EPS = 1e-5


def layer_norm_oracle(x, w, b=None):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + EPS) * w
    return y if b is None else y + b


def rms_norm_oracle(x, w):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w


OPS = {  # name: (op, oracle, PyTorch's own op, parameter count)
    "layer_norm": (lambda x, w, b: K.layer_norm(x, w, b, EPS), layer_norm_oracle,
                   lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS), 2),
    "layer_norm-no-bias": (lambda x, w: K.layer_norm(x, w, None, EPS), layer_norm_oracle,
                           lambda x, w: F.layer_norm(x, x.shape[-1:], w, None, EPS), 1),
    "rms_norm": (lambda x, w: K.rms_norm(x, w, EPS), rms_norm_oracle,
                 lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS), 1),
}
# Hidden sizes of 1 or 2 are left out: there the normalised output is constant and the input
# gradient vanishes, so relative errors of a zero gradient would measure nothing.
# Under the looped cap of 16: 2x3x40 a 3-D input of 6 rows of two full blocks and a partial one (the interpreter
# runs each row's program, so few rows), 5x100 rows of 7 blocks, 9x3 tiles of 4 rows, the last of 1.
SHAPES = {"2x3x40": (2, 3, 40), "5x100": (5, 100), "9x3": (9, 3), "one-row": (1, 40)}


def inputs(op: str, shape: tuple, dtype: torch.dtype, layout=lambda t: t) -> list[torch.Tensor]:
    n = shape[-1]
    x = layout(torch.randn(shape) * 3 + 1)
    params = [1 + 0.5 * torch.randn(n), 0.5 * torch.randn(n)][: OPS[op][3]]
    return [t.to(dtype) for t in [x, *params]]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_matches_float64(backend, max_block, op, shape, dtype):
    fn, oracle, native, _ = OPS[op]
    check(op, fn, oracle, native, inputs(op, SHAPES[shape], dtype))


@pytest.mark.parametrize("layout", [transposed_layout, padded_rows], ids=["last-dim-strided", "padded-rows"])
@pytest.mark.parametrize("op", OPS)
def test_norm_non_contiguous(backend, op, layout):
    fn, oracle, native, _ = OPS[op]
    check(op, fn, oracle, native, inputs(op, (6, 5, 24), torch.float32, layout), dy_layout=layout)


@pytest.mark.parametrize("op", OPS)
def test_norm_float32_params_with_bfloat16_input(backend, op):
    """Mixed precision: bf16 activations, float32 weights; y in bf16, weight gradients in float32."""
    fn, _, _, _ = OPS[op]
    x, *params = inputs(op, (4, 33), torch.float32)
    xb = x.bfloat16().requires_grad_()
    params = [p.requires_grad_() for p in params]
    y = fn(xb, *params)
    grads = torch.autograd.grad(y, [xb, *params], torch.ones_like(y))
    assert y.dtype == torch.bfloat16 and grads[0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads[1:])



@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_multi_row_tiles_match_float64(backend, op, dtype):
    """70 rows of 200: 5 forward tiles of 16 rows, the last of 6; backward groups (4 under the interpreter)
    of 32, 32 and 6 rows, two tiles each, the last partial. (Under the looped cap these are plain looped
    rows, which the shapes above cover.)"""
    assert launch.row_tile(70, 200) == (16, 256, False)
    assert launch.partial_groups(torch.device("cpu"), 70, multiple=16) == (3, 32)
    fn, oracle, native, _ = OPS[op]
    check(op, fn, oracle, native, inputs(op, (70, 200), dtype))
