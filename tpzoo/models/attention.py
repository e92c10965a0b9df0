"""Self-attention with grouped-query heads (Ainslie et al. 2023), rotary or partial rotary positions,
query/key norms, a sliding window, and causal, padding and document masks: plain PyTorch.

n query heads of d features share g key/value heads (g = n: multi-head, g = 1: multi-query), each kv
head serving n/g consecutive query heads. The fused QKV weight [(n + 2g) d, h] is laid out group by
group, [q heads of group 0 | k_0 | v_0 | q heads of group 1 | k_1 | v_1 | ...], d rows a head, so a
run of whole groups is a self-contained attention (Hugging Face keeps separate or [q; k; v]
projections; ``tpzoo.convert`` permutes). The module reads how many groups it holds from the shapes:

    QKV = X W_qkv (+ b_qkv)                 [b, s, G (n/g + 2) d]   G groups: g, or g/tp on a tp rank
    O   = softmax(Q K^T / sqrt(d) + M) V    per head (``CoreAttention``)
    Y   = O W_o (+ b_o)                     [b, s, h]               a tp rank: its partial sum

so its sharding plan (``ATTENTION_PLAN``: the fused QKV split in whole groups, W_o by the matching
columns, the core computing on this rank's heads) runs the same code on every rank of any tp.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo import kernels as K
from tpzoo.models.kv_cache import KVCache
from tpzoo.models.norms import norm
from tpzoo.models.rope import RotaryEmbedding
from tpzoo import placement
from tpzoo.placement import Placement, by_query_blocks, hidden
from tpzoo.models.weights import linear

# the plan of an ``Attention`` (paths inside it): see tpzoo.sharding_plan for the styles
ATTENTION_PLAN = {"query_key_value": "grouped_qkv", "q_norm": "partial", "k_norm": "partial",
                  "core_attention": "heads", "dense": "row"}


def padding_mask(attention_mask: Tensor | None) -> Tensor | None:
    """Hugging Face's attention_mask [b, s] (1 = token, 0 = padding) -> bool [b, 1, 1, s], True = masked out."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, seq] with 1 = token, 0 = padding; "
                         f"got shape {tuple(attention_mask.shape)}")
    return (attention_mask == 0)[:, None, None, :]


def document_mask(document_ids: Tensor) -> Tensor:
    """Packed documents: ids [b, s] (the document of each token) -> bool [b, 1, s, s], True where a query and
    a key lie in different documents (masked out)."""
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}")
    return (document_ids[:, :, None] != document_ids[:, None, :])[:, None]


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + M) v per head: q [b, n, sq, d], k and v [b, n, sk, d] -> [b, n, sq, d].

    M masks out (True = masked, Megatron-LM's convention): with ``causal`` the keys after each query (query
    i sees keys <= i + sk - sq, cached ones included), with ``window`` also the keys ``window`` or more
    positions before it (a sliding window), and the ``mask`` given: bool, broadcastable to [b, n, sq, sk]
    (``padding_mask``, ``document_mask``), or a ``tpzoo.placement.Placement`` of the tokens (documents and
    padding as ids: a sequence longer than ``tpzoo.placement.QUERY_BLOCK`` is then attended a block of queries
    at a time, ``by_query_blocks``, never with a dense [s, s] mask). ``p``: dropout on the probabilities while
    training. Run options (``tpzoo.parallel.parallelize`` sets them from the plan): ``attention_backend`` "sdpa"
    (torch's fused attention) or "fused-softmax" (the scores, then ``tpzoo.kernels``' softmax, whose backend is
    ``kernels``);
    ``context_parallel``: under context parallelism, the attention over the whole sequence of which this rank
    holds q, k and v of its pieces (``tpzoo.parallel.context_attention``; it needs a ``Placement``).
    """

    def __init__(self, *, causal: bool = True, p: float = 0.0, window: int | None = None) -> None:
        super().__init__()
        if window is not None and (window < 1 or not causal):
            raise ValueError(f"window={window}: a sliding window is >= 1 keys of a causal attention")
        self.causal, self.p, self.window = causal, p, window
        self.attention_backend, self.kernels, self.context_parallel = "sdpa", None, None

    def masked(self, mask: Tensor | None, sq: int, sk: int, device: torch.device) -> Tensor | None:
        """M as one bool tensor (broadcastable to [b, n, sq, sk]), or None when nothing is masked."""
        if not self.causal:
            return mask
        query = torch.arange(sq, device=device)[:, None] + (sk - sq)
        key = torch.arange(sk, device=device)[None]
        out = key > query
        if self.window is not None:
            out = out | (key <= query - self.window)
        return out if mask is None else out | mask

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | Placement | None = None) -> Tensor:
        sq, sk = q.shape[2], k.shape[2]
        p = self.p if self.training else 0.0
        if self.context_parallel is not None:
            if not isinstance(mask, Placement):
                raise ValueError("under context parallelism attention needs where its tokens sit: run the model with "
                                 "sequence_index (the engine's cut gives it)")
            return self.context_parallel(q, k, v, mask, causal=self.causal, window=self.window, dropout=p)
        if isinstance(mask, Placement):  # whole sequences here: causal by position below, documents and padding
            if sq > placement.QUERY_BLOCK and (mask.doc is not None or mask.valid is not None):
                return by_query_blocks(lambda *qkvm: self.with_mask(*qkvm, p), q, k, v, mask, self.causal,
                                       self.window)
            mask = hidden(mask, mask, causal=False)
        plain_causal = self.causal and self.window is None and mask is None
        if plain_causal and self.attention_backend == "sdpa" and sq == sk:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        if plain_causal and self.attention_backend != "sdpa":
            scores = torch.matmul(q, k.transpose(-1, -2))                             # [b, n, sq, sk]
            probs = K.scaled_causal_softmax(scores, 1.0 / math.sqrt(q.shape[-1]), backend=self.kernels)
            return self.dropped(probs, p).matmul(v)
        return self.with_mask(q, k, v, self.masked(mask, sq, sk, q.device), p)

    def with_mask(self, q: Tensor, k: Tensor, v: Tensor, masked: Tensor | None, p: float) -> Tensor:
        """softmax(q k^T / sqrt(d) + M) v for the whole of M (bool, True = masked; None: nothing), by the backend."""
        if self.attention_backend == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None if masked is None else ~masked, dropout_p=p)
        scores = torch.matmul(q, k.transpose(-1, -2))                                 # [b, n, sq, sk]
        probs = K.scaled_masked_softmax(scores, masked, 1.0 / math.sqrt(q.shape[-1]), backend=self.kernels)
        return self.dropped(probs, p).matmul(v)

    @staticmethod
    def dropped(probs: Tensor, p: float) -> Tensor:
        return F.dropout(probs, p, training=True) if p > 0 else probs

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, p={self.p}, window={self.window}, attention_backend={self.attention_backend}, "
                f"kernels={self.kernels}")


class Attention(nn.Module):
    """Self-attention [b, s, h] -> [b, s, h] (see module docstring).

    ``num_query_groups``: g kv heads (None: g = n); ``head_dim``: d (None: h / n); ``qkv_bias`` and
    ``out_bias``: biases on the fused QKV and on the output projection; ``rotary``: turns queries and keys
    (None: no rotary positions); ``qk_norm``: a norm ("LayerNorm" | "RMSNorm", epsilon ``norm_epsilon``)
    over each head's queries and keys before they turn; ``causal``, ``window``, ``dropout``: the
    ``CoreAttention``'s. Weights ~ N(0, ``init_std``^2), the output projection's ``out_init_std``.
    forward(x, mask, cache): ``mask`` as ``CoreAttention`` takes it; ``cache`` holds the keys and values of
    earlier tokens (decoding), under ``layer_number``.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, *, num_query_groups: int | None = None,
                 head_dim: int | None = None, causal: bool = True, window: int | None = None, dropout: float = 0.0,
                 qkv_bias: bool = True, out_bias: bool = True, rotary: RotaryEmbedding | None = None,
                 qk_norm: str | None = None, norm_epsilon: float = 1e-6, init_std: float = 0.02,
                 out_init_std: float = 0.02, layer_number: int = 0) -> None:
        super().__init__()
        n, g = num_attention_heads, num_query_groups or num_attention_heads
        if n % g or (head_dim is None and hidden_size % n):
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_attention_heads={n} (or give "
                             f"head_dim), and that by num_query_groups={g} (each kv head serves n/g query heads)")
        d = head_dim or hidden_size // n
        self.num_attention_heads, self.num_query_groups, self.head_dim = n, g, d
        self.layer_number, self.rotary = layer_number, rotary
        self.query_key_value = linear(hidden_size, (n + 2 * g) * d, qkv_bias, init_std)
        self.q_norm = norm(qk_norm, d, norm_epsilon) if qk_norm else None
        self.k_norm = norm(qk_norm, d, norm_epsilon) if qk_norm else None
        self.core_attention = CoreAttention(causal=causal, p=dropout, window=window)
        self.dense = linear(n * d, hidden_size, out_bias, out_init_std)

    def forward(self, x: Tensor, mask: Tensor | Placement | None = None, cache: KVCache | None = None) -> Tensor:
        qkv = self.query_key_value(x)                                            # [b, s, G (n/g + 2) d]
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, -1, self.num_attention_heads // self.num_query_groups + 2, self.head_dim)
        q = qkv[:, :, :, :-2].reshape(b, s, -1, self.head_dim).transpose(1, 2)  # [b, G n/g, s, d]
        k, v = (t.transpose(1, 2) for t in qkv[:, :, :, -2:].unbind(3))          # [b, G, s, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None and isinstance(mask, Placement):
            q, k = self.rotary(q, k, positions=mask.rotary_positions)
        elif self.rotary is not None:
            q, k = self.rotary(q, k, cache.length if cache is not None else 0)
        if cache is not None:
            k, v = cache.update(self.layer_number, k, v)                        # [b, G, t + s, d]
        if q.shape[1] > k.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        context = self.core_attention(q, k, v, mask)                            # [b, G n/g, s, d]
        return self.dense(context.transpose(1, 2).reshape(b, s, -1))
