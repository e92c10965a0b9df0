"""scaled_masked_softmax and scaled_causal_softmax against a float64 oracle, both backends."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPES, check, padded_rows, transposed_layout

from tpzoo import kernels as K
from tpzoo.kernels import launch

pytestmark = pytest.mark.tier("unit")




def visible(sq: int, sk: int) -> torch.Tensor:
    """[sq, sk] bool: key k is visible from query q when k <= q + sk - sq."""
    return torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)


def oracle(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax over the kept keys, written out; rows with no kept key are 0."""
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else ~mask.expand(x.shape)
    s = x * scale
    top = torch.where(keep, s, float("-inf")).amax(-1, keepdim=True).detach()
    e = torch.where(keep, torch.exp(s - torch.where(keep.any(-1, keepdim=True), top, 0.0)), 0.0)
    return e / e.sum(-1, keepdim=True).clamp_min(1e-300)


def native(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """PyTorch's own ops in x's dtype (fully masked rows: NaN -> 0)."""
    s = x * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0)


def padding_mask(b: int, sk: int) -> torch.Tensor:
    """[b, 1, 1, sk]: a random number of trailing padding keys per sequence; the last one all padding."""
    lengths = torch.randint(1, sk + 1, (b,))
    lengths[-1] = 0
    return (torch.arange(sk) >= lengths[:, None]).view(b, 1, 1, sk)


def full_mask(b: int, sq: int, sk: int) -> torch.Tensor:
    """[b, 1, sq, sk]: random holes, with the first and last query rows of batch 0 fully masked."""
    mask = torch.rand(b, 1, sq, sk) < 0.3
    mask[0, 0, [0, -1]] = True
    return mask


MASKED_CASES = {
    "padding": lambda: (torch.randn(2, 2, 3, 37), padding_mask(2, 37)),
    "full": lambda: (torch.randn(2, 1, 6, 37), full_mask(2, 6, 37)),
    "no-mask-long-row": lambda: (torch.randn(1, 2, 3, 100), None),
    "tiny-rows": lambda: (torch.randn(2, 2, 3, 1), padding_mask(2, 1)),
    "two-keys-full": lambda: (torch.randn(2, 4, 16, 2), full_mask(2, 16, 2)),
    "per-head-mask": lambda: (torch.randn(2, 3, 4, 21), torch.rand(1, 3, 4, 21) < 0.5),
}


@pytest.mark.parametrize("case", MASKED_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_softmax_matches_float64(backend, max_block, case, dtype):
    x, mask = MASKED_CASES[case]()
    x = x * 4
    check("scaled_masked_softmax", lambda x: K.scaled_masked_softmax(x, mask, 0.3), lambda x: oracle(x, mask, 0.3),
          lambda x: native(x, mask, 0.3), [x.to(dtype)])


@pytest.mark.parametrize("sq, sk", [(37, 37), (5, 37), (9, 5), (1, 1)], ids=["square", "kv-cache", "sq>sk", "1x1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_softmax_matches_float64(backend, max_block, sq, sk, dtype):
    x = (torch.randn(1, 1, sq, sk) * 4).to(dtype)
    mask = ~visible(sq, sk)
    check("scaled_causal_softmax", lambda x: K.scaled_causal_softmax(x, 0.7), lambda x: oracle(x, mask, 0.7),
          lambda x: native(x, mask, 0.7), [x])


@pytest.mark.parametrize("causal", [False, True], ids=["masked", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_multi_row_tiles_match_float64(backend, causal, dtype):
    """300 rows of 20 keys: tiles of 128 rows, the last of 44; causal with sq > sk (fully masked rows)."""
    assert launch.row_tile(300, 20) == (128, 32, False)
    x = (torch.randn(3, 2, 50, 20) * 4).to(dtype)
    mask = ~visible(50, 20) if causal else full_mask(3, 50, 20)
    if causal:
        label, op = "scaled_causal_softmax", lambda x: K.scaled_causal_softmax(x, 0.7)
    else:
        label, op = "scaled_masked_softmax", lambda x: K.scaled_masked_softmax(x, mask, 0.7)
    check(label, op, lambda x: oracle(x, mask, 0.7), lambda x: native(x, mask, 0.7), [x])


@pytest.mark.parametrize("layout", [transposed_layout, padded_rows,
                                    lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)],
                         ids=["last-dim-strided", "padded-rows", "heads-strided"])
@pytest.mark.parametrize("causal", [False, True], ids=["masked", "causal"])
def test_softmax_non_contiguous(backend, layout, causal):
    x = layout(torch.randn(2, 3, 19, 19) * 4)
    mask = ~visible(19, 19) if causal else padding_mask(2, 19)
    if causal:
        label, op = "scaled_causal_softmax", lambda x: K.scaled_causal_softmax(x, 0.5)
    else:
        label, op = "scaled_masked_softmax", lambda x: K.scaled_masked_softmax(x, mask, 0.5)
    check(label, op, lambda x: oracle(x, mask, 0.5), lambda x: native(x, mask, 0.5), [x], dy_layout=layout)


def test_fully_masked_rows_are_zero_with_zero_gradient(backend):
    x = torch.randn(2, 2, 3, 10, requires_grad=True)
    mask = padding_mask(2, 10)
    y = K.scaled_masked_softmax(x, mask, 1.0)
    (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert torch.equal(y[-1], torch.zeros_like(y[-1])) and torch.equal(dx[-1], torch.zeros_like(dx[-1]))
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
