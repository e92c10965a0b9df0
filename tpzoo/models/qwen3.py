"""Qwen3 (Qwen team 2025): a Llama with an RMSNorm over each head's queries and keys before they turn
(``qk_layernorm``) and a head size of its own (``kv_channels``: Qwen3-0.6B has 16 heads of 128 over a width of
1024); the block library's decoder built from a ``Qwen3Config``, split by ``DECODER_PLAN``.

    model = Qwen3Model(get_preset("qwen3-0.6b"))     # plain PyTorch, one device

The query and key norms hold d weights each, the same on every tp rank (each rank norms its own heads; their
gradients are summed over tp). Hugging Face ``Qwen3ForCausalLM`` and ``Qwen3ForSequenceClassification`` convert
both ways; attention biases and its sliding window are refused.
"""

from __future__ import annotations

from typing import Any

from tpzoo.models.causal_lm import CausalLM, SequenceClassifier
from tpzoo.models.config import Qwen3Config
from tpzoo.models.hf_rules import require
from tpzoo.models.llama import config_from_hf, llama_like_spec


class Qwen3Model(CausalLM):
    """Qwen3: ``LlamaModel``'s parts, with query and key RMSNorms and any head size."""

    model_type = "qwen3"
    config_class = Qwen3Config


class Qwen3ForSequenceClassification(SequenceClassifier, Qwen3Model):
    """Qwen3 as a classifier (Hugging Face's Qwen3ForSequenceClassification): ``score`` at the last real token."""


def _from_hf(hf: Any, arch: str) -> Qwen3Config:
    require(not getattr(hf, "attention_bias", False), "attention_bias=True")
    require(not getattr(hf, "use_sliding_window", False), "use_sliding_window=True (Qwen3's per-layer window)")
    return config_from_hf(hf, arch, Qwen3Config)


SPEC = llama_like_spec(Qwen3Model, Qwen3ForSequenceClassification, "Qwen3Config", _from_hf)
