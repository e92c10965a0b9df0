"""Self-attention with the heads split across tensor-parallel ranks (Megatron-LM sec. 3).

With n heads of d = h / n features and p = tp ranks, rank r owns heads r n/p ... (r+1) n/p - 1:

    QKV = X W_qkv          W_qkv = [W_1 ... W_p] column-parallel, [3h/p, h] per rank
    O_r = softmax(Q_r K_r^T / sqrt(d)) V_r      (the rank's n/p heads, no communication)
    Y   = sum_r O_r W_o,r  W_o = [W_o,1; ...; W_o,p] row-parallel, [h, h/p] per rank

The fused QKV weight [3h, h] is laid out head by head, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], each
block d rows, so a contiguous 1/p of the rows holds whole heads and the full weight is the same
at every tp. (Hugging Face keeps [q; k; v]; ``tpzoo.convert`` permutes.)
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo import kernels as K
from tpzoo.models.config import TransformerConfig
from tpzoo.models.kv_cache import KVCache
from tpzoo.parallel import ColumnParallelLinear, ParallelMesh, RowParallelLinear, init_method_normal


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
    """Multi-head self-attention: [b, s, h] -> ([b, s, h] before the output bias, the bias [h]).

    With ``config.sequence_parallel`` the input and output are [b, s/tp, h]: the QKV projection
    all-gathers the sequence, the output projection reduce-scatters it. ``mask``: bool,
    broadcastable to [b, n, s, s], True = masked out; causal models pass None. ``cache``: the
    keys and values of earlier tokens (decoding), kept under ``layer_number``.
    """

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh, layer_number: int = 0) -> None:
        super().__init__()
        self.config, self.mesh, self.layer_number = config, mesh, layer_number
        tp = mesh.tp_size
        self.heads_per_rank = config.num_attention_heads // tp
        self.head_dim = config.head_dim
        self.backend = resolve_attention_backend(config.attention_backend)
        sp = config.sequence_parallel
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size, 3 * config.hidden_size, init_method=init_method_normal(config.init_method_std),
            sequence_parallel=sp, tp_group=mesh.tp_group)
        self.dense = RowParallelLinear(
            config.hidden_size, config.hidden_size, init_method=init_method_normal(config.output_init_std),
            skip_bias_add=True, sequence_parallel=sp, tp_group=mesh.tp_group)

    def forward(self, x: Tensor, mask: Tensor | None = None, cache: KVCache | None = None) -> tuple[Tensor, Tensor]:
        qkv = self.query_key_value(x)                                    # [b, s, 3h/tp]
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.heads_per_rank, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))              # [b, n/tp, s, d] each
        if cache is not None:
            k, v = cache.update(self.layer_number, k, v)                  # [b, n/tp, t + s, d]
        context = self.core_attention(q, k, v, mask)                      # [b, n/tp, s, d]
        context = context.transpose(1, 2).reshape(b, s, self.heads_per_rank * self.head_dim)
        return self.dense(context)

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """softmax(q k^T / sqrt(d) + mask) v per head, with attention dropout drawn from the tp stream."""
        p = self.config.attention_dropout if self.training else 0.0
        causal = self.config.causal
        if causal and mask is not None:
            raise ValueError("causal attention takes no padding mask")
        # Each tp rank holds other heads: their dropout masks must differ, so draw from the "tp" stream.
        rng = self.mesh.rng.fork() if p > 0 else nullcontext()
        if self.backend == "sdpa":
            keep = None if mask is None else ~mask
            sq, sk = q.shape[2], k.shape[2]
            if causal and sq != sk:  # decoding with cached keys: query i sees keys <= i + sk - sq
                keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            with rng:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p,
                                                      is_causal=causal and sq == sk)
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = torch.matmul(q, k.transpose(-1, -2))                     # [b, n/tp, s, s]
        kernels = self.config.kernels
        if causal:
            probs = K.scaled_causal_softmax(scores, scale, backend=kernels)
        else:
            probs = K.scaled_masked_softmax(scores, mask, scale, backend=kernels)
        if p > 0:
            with rng:
                probs = F.dropout(probs, p, training=True)
        return torch.matmul(probs, v)
