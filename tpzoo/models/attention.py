"""Self-attention with the heads split across tensor-parallel ranks (Megatron-LM sec. 3), with
grouped-query attention (Ainslie et al. 2023) and optional rotary positions.

n query heads of d features share g key/value heads (g = n: multi-head, g = 1: multi-query), each
kv head serving n/g consecutive query heads. With p = tp ranks, rank r owns groups r g/p ...
(r+1) g/p - 1, i.e. their query heads and their kv heads (p must divide g: kv heads are never
replicated across ranks):

    QKV = X W_qkv          W_qkv = [W_1 ... W_p] column-parallel, [(n + 2g) d / p, h] per rank
    O_r = softmax(Q_r K_r^T / sqrt(d)) V_r      (the rank's groups, no communication)
    Y   = sum_r O_r W_o,r  W_o = [W_o,1; ...; W_o,p] row-parallel, [h, n d / p] per rank

The fused QKV weight [(n + 2g) d, h] is laid out group by group, [q heads of group 0 | k_0 | v_0 |
q heads of group 1 | k_1 | v_1 | ...], each head d rows, so a contiguous 1/p of the rows holds whole
groups and the full weight is the same at every tp. With g = n this is [q_0 k_0 v_0 | q_1 k_1 v_1
| ...]. (Hugging Face keeps separate or [q; k; v] projections; ``tpzoo.convert`` permutes.)
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo import kernels as K
from tpzoo.models.kv_cache import KVCache
from tpzoo.models.recompute import recompute
from tpzoo.models.rope import RotaryEmbedding
from tpzoo.models.transformer import in_tp_stream
from tpzoo.parallel import ColumnParallelLinear, ParallelPlan, RowParallelLinear, init_method_normal


def resolve_attention_backend(backend: str) -> str:
    """"fused-softmax" or "sdpa" for ``--attention-backend``.

    auto: sdpa on every device. Its fused kernels (flash or memory-efficient attention on CUDA, a
    flash kernel on the CPU) never materialize the [b, n, s, s] scores that the fused softmax needs,
    and measured faster on the CPU too (docs/models.md).
    """
    if backend in ("fused-softmax", "sdpa"):
        return backend
    if backend != "auto":
        raise ValueError(f"attention backend must be auto, fused-softmax or sdpa, got {backend!r}")
    return "sdpa"


def padding_mask(attention_mask: Tensor | None) -> Tensor | None:
    """Hugging Face's attention_mask [b, s] (1 = token, 0 = padding) -> bool [b, 1, 1, s], True = masked out."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, seq] with 1 = token, 0 = padding; "
                         f"got shape {tuple(attention_mask.shape)}")
    return (attention_mask == 0)[:, None, None, :]


class ParallelAttention(nn.Module):
    """Self-attention: [b, s, h] -> ([b, s, h] before the output bias, the bias [h] or None).

    ``num_query_groups``: g kv heads (None: g = n). ``causal``: token t sees tokens <= t, else the
    ``mask`` given to forward (bool, broadcastable to [b, n, s, s], True = masked out) or nothing.
    ``rotary``: rotate queries and keys (rotary positions) or None. ``bias``: biases on both
    projections. With ``plan.sequence_parallel`` input and output are [b, s/tp, h] (the QKV projection
    all-gathers the sequence, the output projection reduce-scatters it). ``cache``: the keys and values
    of earlier tokens (decoding), kept under ``layer_number``.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, plan: ParallelPlan, *,
                 num_query_groups: int | None = None, causal: bool = True, bias: bool = True,
                 attention_dropout: float = 0.0, init_std: float = 0.02, output_init_std: float = 0.02,
                 rotary: RotaryEmbedding | None = None, layer_number: int = 0) -> None:
        super().__init__()
        n, g, tp = num_attention_heads, num_query_groups or num_attention_heads, plan.tp_size
        if hidden_size % n or n % g:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_attention_heads={n}, and that by "
                             f"num_query_groups={g} (each kv head serves n/g query heads)")
        if n % tp:
            raise ValueError(f"num_attention_heads={n} is not divisible by the tensor-parallel size tp={tp}: tp ranks "
                             f"split the heads; choose tp dividing {n}")
        if g % tp:
            raise ValueError(f"num_query_groups={g} is not divisible by the tensor-parallel size tp={tp}: each tp rank "
                             f"holds whole key/value heads (tpzoo does not replicate them across ranks); choose tp "
                             f"dividing {g}")
        self.plan, self.layer_number, self.causal, self.rotary = plan, layer_number, causal, rotary
        self.mesh = plan.mesh
        self.head_dim, self.heads_per_group = hidden_size // n, n // g
        self.groups_per_rank, self.heads_per_rank = g // tp, n // tp
        self.attention_dropout = attention_dropout
        self.backend = resolve_attention_backend(plan.attention_backend)
        sp = plan.sequence_parallel
        self.query_key_value = ColumnParallelLinear(
            hidden_size, (n + 2 * g) * self.head_dim, bias=bias, init_method=init_method_normal(init_std),
            sequence_parallel=sp, tp_group=self.mesh.tp_group)
        self.dense = RowParallelLinear(
            n * self.head_dim, hidden_size, bias=bias, init_method=init_method_normal(output_init_std),
            skip_bias_add=True, sequence_parallel=sp, tp_group=self.mesh.tp_group)

    def forward(self, x: Tensor, mask: Tensor | None = None, cache: KVCache | None = None
                ) -> tuple[Tensor, Tensor | None]:
        qkv = self.query_key_value(x)                                     # [b, s, (n + 2g) d / tp]
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.groups_per_rank, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, :-2].reshape(b, s, self.heads_per_rank, self.head_dim).transpose(1, 2)  # [b, n/tp, s, d]
        k, v = (t.transpose(1, 2) for t in qkv[:, :, :, -2:].unbind(3))                          # [b, g/tp, s, d]
        if self.rotary is not None:
            q, k = self.rotary(q, k, cache.length if cache is not None else 0)
        if cache is not None:
            k, v = cache.update(self.layer_number, k, v)                  # [b, g/tp, t + s, d]
        if self.heads_per_group > 1:
            k, v = (t.repeat_interleave(self.heads_per_group, dim=1) for t in (k, v))
        if self.plan.recompute_granularity == "selective" and self.training and torch.is_grad_enabled():
            context = recompute(self.core_attention, self.mesh.rng, q, k, v, mask)  # Megatron's selective recompute
        else:
            context = self.core_attention(q, k, v, mask)                  # [b, n/tp, s, d]
        context = context.transpose(1, 2).reshape(b, s, self.heads_per_rank * self.head_dim)
        return self.dense(context)

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """softmax(q k^T / sqrt(d) + mask) v per head, with attention dropout drawn from the tp stream."""
        p = self.attention_dropout if self.training else 0.0
        causal, kernels = self.causal, self.plan.kernels
        if causal and mask is not None:
            raise ValueError("causal attention takes no padding mask")
        # Each tp rank holds other heads: their dropout masks must differ, so draw from the "tp" stream.
        if self.backend == "sdpa":
            keep = None if mask is None else ~mask
            sq, sk = q.shape[2], k.shape[2]
            if causal and sq != sk:  # decoding with cached keys: query i sees keys <= i + sk - sq
                keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            attend = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=keep, dropout_p=p,
                             is_causal=causal and sq == sk)
            return in_tp_stream(self.mesh, attend) if p > 0 else attend()
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = torch.matmul(q, k.transpose(-1, -2))                     # [b, n/tp, s, s]
        if causal:
            probs = K.scaled_causal_softmax(scores, scale, backend=kernels)
        else:
            probs = K.scaled_masked_softmax(scores, mask, scale, backend=kernels)
        if p > 0:
            probs = in_tp_stream(self.mesh, F.dropout, probs, p, training=True)
        return torch.matmul(probs, v)
