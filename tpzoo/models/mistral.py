"""Mistral 7B (Jiang et al. 2023): a Llama whose attention looks back a sliding window of ``window_size``
tokens (Mistral 7B v0.1: 4096; None in the later versions); the block library's decoder built from a
``MistralConfig``, split by ``DECODER_PLAN``.

    model = MistralModel(get_preset("mistral-7b"))   # plain PyTorch, one device

The window is a mask (``CoreAttention``): query t sees keys t - window_size + 1 .. t, with either attention
backend and through the KV cache (whose keys are kept whole; the mask hides the old ones). Hugging Face
``MistralForCausalLM`` and ``MistralForSequenceClassification`` convert both ways.
"""

from __future__ import annotations

from tpzoo.models.causal_lm import CausalLM, SequenceClassifier
from tpzoo.models.config import MistralConfig
from tpzoo.models.llama import config_from_hf, llama_like_spec


class MistralModel(CausalLM):
    """Mistral: ``LlamaModel``'s parts, with a sliding-window attention."""

    model_type = "mistral"
    config_class = MistralConfig


class MistralForSequenceClassification(SequenceClassifier, MistralModel):
    """Mistral as a classifier (Hugging Face's MistralForSequenceClassification): ``score`` at the last real token."""


SPEC = llama_like_spec(MistralModel, MistralForSequenceClassification, "MistralConfig",
                       lambda hf, arch: config_from_hf(hf, arch, MistralConfig, window_size=hf.sliding_window),
                       sliding_window=lambda c: c.window_size)
