"""GPT (the GPT-2 architecture): learned positions, pre-LN causal layers with GELU MLPs and biases, a
final LayerNorm, and an output layer tied to the word embeddings; the block library's decoder
(``CausalLM``) built from a ``TransformerConfig``, split by ``DECODER_PLAN``.

    model = GPTModel(get_preset("gpt2"))       # plain PyTorch, one device
    logits = model(input_ids)                  # [b, s, V]
    loss = model(input_ids, labels=labels)     # [b, s] per-token loss (see ``CausalLM``)
    clf = GPTForSequenceClassification(config) # a classifier read at the last real token (``SequenceClassifier``)

GPT-2 scales the init of the projections into the residual stream by 1 / sqrt(2 num_layers).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tpzoo.models.causal_lm import CausalLM, SequenceClassifier
from tpzoo.models.config import TransformerConfig
from tpzoo.models.families import FamilySpec, HFAdapter
from tpzoo.models.hf_rules import (
    Rule,
    gelu_from_hf,
    gelu_to_hf,
    heads_from_qkv,
    is_classifier,
    labels_from_hf,
    labels_to_hf,
    linear,
    qkv_from_heads,
    require,
    same,
    tied,
    transformers_module,
)
from tpzoo.models.presets import layer_parameters


class GPTModel(CausalLM):
    """GPT-2: ``embedding`` (word + position), ``layers`` (pre-LN, causal), ``head`` (final LN, tied output)."""

    model_type = "gpt"
    config_class = TransformerConfig

    def output_init_std(self) -> float:
        return self.config.init_method_std / math.sqrt(2.0 * self.config.num_layers)


class GPTForSequenceClassification(SequenceClassifier, GPTModel):
    """GPT-2 as a classifier (Hugging Face's GPT2ForSequenceClassification): ``score`` at the last real token."""


def num_parameters(c: TransformerConfig, head: str | None = None) -> int:
    """Parameters of GPT2LMHeadModel of this config (``head`` "lm", the default) or of
    GPT2ForSequenceClassification (``head`` "classification")."""
    if head not in (None, "lm", "classification"):
        raise ValueError(f"head {head!r} does not apply to a gpt config; choose 'lm' or 'classification'")
    h, v = c.hidden_size, c.vocab_size
    layer = layer_parameters(h, c.ffn_size, c.num_attention_heads, c.num_attention_heads, bias=True, gated=False,
                             norm_params=2 * h)
    out = c.num_labels * h if head == "classification" else 0 if c.tie_word_embeddings else v * h
    return v * h + out + c.max_position_embeddings * h + c.num_layers * layer + 2 * h


# ------------------------------------------------------------------- Hugging Face GPT2LMHeadModel

def _config_from_hf(hf: Any, arch: str) -> TransformerConfig:
    """The TransformerConfig of a GPT2Config (dropout probabilities included)."""
    require(hf.scale_attn_weights, "scale_attn_weights=False")
    require(not hf.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=True")
    require(not hf.add_cross_attention, "add_cross_attention=True")
    return TransformerConfig(
        model_type="gpt", num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head,
        ffn_hidden_size=hf.n_inner, vocab_size=hf.vocab_size, max_position_embeddings=hf.n_positions,
        hidden_dropout=hf.resid_pdrop, attention_dropout=hf.attn_pdrop, layernorm_epsilon=hf.layer_norm_epsilon,
        layernorm_position="pre", activation=gelu_from_hf(hf.activation_function),
        tie_word_embeddings=hf.tie_word_embeddings, init_method_std=hf.initializer_range, **labels_from_hf(hf, arch))


def _config_to_hf(c: TransformerConfig, arch: str) -> Any:
    """The GPT2Config of a TransformerConfig (end of text = the last token, as in GPT-2's vocabulary)."""
    return transformers_module().GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size, n_layer=c.num_layers,
        n_head=c.num_attention_heads, n_inner=c.ffn_hidden_size, activation_function=gelu_to_hf(c.activation),
        resid_pdrop=c.hidden_dropout, embd_pdrop=c.hidden_dropout, attn_pdrop=c.attention_dropout,
        layer_norm_epsilon=c.layernorm_epsilon, initializer_range=c.init_method_std,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.vocab_size - 1, eos_token_id=c.vocab_size - 1,
        architectures=[arch], **labels_to_hf(c, arch))


def _rules(c: TransformerConfig, arch: str) -> list[Rule]:
    """The tensors of GPT2LMHeadModel (or GPT2ForSequenceClassification: ``score``, no LM head): Conv1D weights are
    [in, out] (transposed), c_attn holds [q k v]."""
    n, lm = c.num_attention_heads, not is_classifier(arch)
    rules = [tied("embedding.word_embeddings.weight", "transformer.wte.weight",
                  *(("lm_head.weight",) if c.tie_word_embeddings and lm else ())),
             same("embedding.position_embeddings.weight", "transformer.wpe.weight")]
    for i in range(c.num_layers):
        t, h = f"layers.{i}.", f"transformer.h.{i}."
        rules += [*linear(f"{t}attention_norm", f"{h}ln_1"), *linear(f"{t}mlp_norm", f"{h}ln_2"),
                  # Conv1D c_attn: weight [h, 3h] = [W_q W_k W_v]^T, bias [3h]
                  Rule(f"{t}self_attention.query_key_value.weight", (f"{h}attn.c_attn.weight",),
                       lambda w: heads_from_qkv(*w.t().chunk(3), heads=n),
                       lambda w: (torch.cat(qkv_from_heads(w, n)).t().contiguous(),), transposed=True),
                  Rule(f"{t}self_attention.query_key_value.bias", (f"{h}attn.c_attn.bias",),
                       lambda b: heads_from_qkv(*b.chunk(3), heads=n),
                       lambda b: (torch.cat(qkv_from_heads(b, n)),))]
        for ours, theirs in (("self_attention.dense", "attn.c_proj"), ("mlp.dense_h_to_4h", "mlp.c_fc"),
                             ("mlp.dense_4h_to_h", "mlp.c_proj")):
            rules += [same(f"{t}{ours}.weight", f"{h}{theirs}.weight", transpose=True),
                      same(f"{t}{ours}.bias", f"{h}{theirs}.bias")]
    rules += linear("head.final_layernorm", "transformer.ln_f")
    if not lm:
        rules.append(same("head.score.weight", "score.weight"))
    elif not c.tie_word_embeddings:
        rules.append(same("head.output_layer.weight", "lm_head.weight"))
    return rules


SPEC = FamilySpec(models={"GPTModel": GPTModel, "GPTForSequenceClassification": GPTForSequenceClassification},
                  pretrain_model="GPTModel", finetune_model="GPTModel", classifier_model="GPTForSequenceClassification",
                  num_parameters=num_parameters,
                  hf=HFAdapter("gpt2", {"GPT2LMHeadModel": ("GPTModel", {}),
                                        "GPT2ForSequenceClassification": ("GPTForSequenceClassification", {})},
                               _config_from_hf, _config_to_hf, _rules))
