"""Qwen2 and Qwen2.5 (Yang et al. 2024): a Llama (rotary grouped-query attention, SwiGLU, RMSNorm) whose query,
key and value projections have biases (``add_qkv_bias``; the output projection and the MLP have none); the
block library's decoder built from a ``Qwen2Config``, split by ``DECODER_PLAN``.

    model = Qwen2Model(get_preset("qwen2.5-0.5b"))   # plain PyTorch, one device

The biases are fused like the weights, [(n + 2g) d] group by group, so a tp rank holds the biases of its own
heads. Hugging Face ``Qwen2ForCausalLM`` and ``Qwen2ForSequenceClassification`` convert both ways; its per-layer
sliding window (``use_sliding_window``) is refused.
"""

from __future__ import annotations

from typing import Any

from tpzoo.models.causal_lm import CausalLM, SequenceClassifier
from tpzoo.models.config import Qwen2Config
from tpzoo.models.hf_rules import require
from tpzoo.models.llama import config_from_hf, llama_like_spec


class Qwen2Model(CausalLM):
    """Qwen2: ``LlamaModel``'s parts, with biases on q, k and v."""

    model_type = "qwen2"
    config_class = Qwen2Config


class Qwen2ForSequenceClassification(SequenceClassifier, Qwen2Model):
    """Qwen2 as a classifier (Hugging Face's Qwen2ForSequenceClassification): ``score`` at the last real token."""


def _from_hf(hf: Any, arch: str) -> Qwen2Config:
    require(not getattr(hf, "use_sliding_window", False), "use_sliding_window=True (Qwen2's per-layer window)")
    return config_from_hf(hf, arch, Qwen2Config)


SPEC = llama_like_spec(Qwen2Model, Qwen2ForSequenceClassification, "Qwen2Config", _from_hf)
