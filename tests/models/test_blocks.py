"""The block library's pieces that today's families do not all use, against their plain math: the core
attention's sliding window and document masks (both backends, decoding with cached keys too), partial
rotary positions, the parallel-residual block, and an attention with biases on q/k/v only and query/key
norms at tp 2 (with its plan applied, with and without sequence parallelism) equal to the plain module."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tpzoo.models import Attention, CoreAttention, ParallelAttention, RotaryEmbedding, TransformerLayer
from tpzoo.models.attention import document_mask, padding_mask
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("unit")



B, N, S, D = 2, 4, 8, 16


def qkv(seed: int, sq: int = S, sk: int = S) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, N, s, D, generator=g) for s in (sq, sk, sk))


def explicit(q, k, v, masked: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with -inf where ``masked`` (True = masked out), in float64."""
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return (scores.masked_fill(masked, float("-inf")).softmax(-1) @ v.double()).float()


def positions(sq: int, sk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(sq)[:, None] + (sk - sq), torch.arange(sk)[None]


@pytest.mark.parametrize("backend", ["sdpa", "fused-softmax"])
@pytest.mark.parametrize("sq", [S, 3], ids=["prefill", "decoding"])
def test_sliding_window_sees_the_last_window_keys(backend, sq):
    core = CoreAttention(causal=True, window=3)
    core.attention_backend = backend
    q, k, v = qkv(0, sq=sq)
    query, key = positions(sq, S)
    expected = explicit(q, k, v, (key > query) | (key <= query - 3))
    torch.testing.assert_close(core(q, k, v), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "fused-softmax"])
def test_document_and_padding_masks_with_causal(backend):
    core = CoreAttention(causal=True)
    core.attention_backend = backend
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]])
    q, k, v = qkv(1)
    query, key = positions(S, S)
    expected = explicit(q, k, v, (key > query) | (docs[:, :, None] != docs[:, None, :])[:, None])
    torch.testing.assert_close(core(q, k, v, document_mask(docs)), expected, rtol=1e-5, atol=1e-5)
    bidirectional = CoreAttention(causal=False)
    bidirectional.attention_backend = backend
    pad = torch.ones(B, S, dtype=torch.long)
    pad[1, 5:] = 0
    torch.testing.assert_close(bidirectional(q, k, v, padding_mask(pad)), explicit(q, k, v, padding_mask(pad)),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"document_ids must be \[batch, seq\], got shape \(8,\)"):
        document_mask(docs[0])
    with pytest.raises(ValueError, match="a sliding window is >= 1 keys of a causal attention"):
        CoreAttention(causal=False, window=4)


def test_partial_rotary_turns_only_its_share_of_each_head():
    q, k, _ = qkv(2)
    partial, whole = RotaryEmbedding(D, 100.0, S, fraction=0.25), RotaryEmbedding(D // 4, 100.0, S)
    turned_q, turned_k = partial(q, k)
    expected_q, expected_k = whole(q[..., :D // 4], k[..., :D // 4])
    assert torch.equal(turned_q[..., D // 4:], q[..., D // 4:]) and torch.equal(turned_k[..., D // 4:], k[..., D // 4:])
    torch.testing.assert_close(turned_q[..., :D // 4], expected_q)
    torch.testing.assert_close(turned_k[..., :D // 4], expected_k)
    with pytest.raises(ValueError, match=r"head_dim=16 x fraction=0.1 = 1.6 must be an even number of features"):
        RotaryEmbedding(D, 100.0, S, fraction=0.1)


def test_parallel_residual_adds_both_branches_to_the_input():
    torch.manual_seed(0)
    attention, mlp = nn.Linear(8, 8), nn.Linear(8, 8)
    norm_a, norm_m = nn.LayerNorm(8), nn.LayerNorm(8)
    layer = TransformerLayer(lambda x, mask, cache: attention(x), mlp, norm_a, norm_m, residual="parallel")
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(layer(x), x + attention(norm_a(x)) + mlp(norm_m(x)))
    with pytest.raises(ValueError, match="residual must be one of pre, post, parallel, got 'sandwich'"):
        TransformerLayer(attention, mlp, norm_a, norm_m, residual="sandwich")


def _attention_at_tp2() -> dict[str, float]:
    """Qwen2-style attention (biases on q/k/v only), with query/key norms and a sliding window, grouped 4 heads
    in 2: the plain module against ParallelAttention at tp 2, without and with sequence parallelism."""
    mesh = init_mesh(tp=2)
    options = dict(num_query_groups=2, qkv_bias=True, out_bias=False, qk_norm="RMSNorm", window=5)
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    plain = Attention(32, 4, rotary=RotaryEmbedding(8, 1000.0, S), **options)
    with torch.no_grad():
        plain.query_key_value.bias.normal_()  # nonzero biases, so a lost bias shows
    expected = plain(x)
    out = {"out_bias": float(plain.dense.bias is None)}
    for sp in (False, True):
        torch.manual_seed(0)
        split = ParallelAttention(32, 4, ParallelPlan(mesh, sequence_parallel=sp),
                                  rotary=RotaryEmbedding(8, 1000.0, S), **options)
        with torch.no_grad():
            bias = split.query_key_value.bias
            bias.copy_(plain.query_key_value.bias.chunk(2)[mesh.tp_rank])
        got, want = (split(x.chunk(2, 1)[mesh.tp_rank]), expected.chunk(2, 1)[mesh.tp_rank]) if sp else \
            (split(x), expected)
        out[f"sp={sp}"] = (got - want).abs().max().item() / want.abs().max().item()
    return out


@pytest.mark.tier("distributed")
def test_attention_with_qkv_biases_norms_and_window_at_tp2_equals_the_plain_one():
    for found in spawn(_attention_at_tp2, 2):
        assert found["out_bias"] == 1.0, found
        assert found["sp=False"] < 1e-5 and found["sp=True"] < 1e-5, found
