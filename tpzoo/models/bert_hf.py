"""BERT as Hugging Face counts and stores it: the parameter count of each head, and the adapter of
BertForPreTraining, BertForMaskedLM and BertForSequenceClassification (``tpzoo.convert``)."""

from __future__ import annotations

from typing import Any

from tpzoo.models.config import TransformerConfig
from tpzoo.models.families import HFAdapter
from tpzoo.models.hf_rules import (Rule, gelu_from_hf, gelu_to_hf, is_classifier, labels_from_hf, labels_to_hf, linear,
                                   qkv, require, same, tied, transformers_module)
from tpzoo.models.presets import layer_parameters


def num_parameters(c: TransformerConfig, head: str | None = None) -> int:
    """Parameters of the Hugging Face BERT of this config. ``head``: "pretraining" (BertModel with its
    binary head = BertForPreTraining, the default), "mlm" (BertModel(add_binary_head=False) =
    BertForMaskedLM) or "classification" (BertForSequenceClassification)."""
    head = head or "pretraining"
    if head not in ("pretraining", "mlm", "classification"):
        raise ValueError(f"head {head!r} does not apply to a bert config; choose pretraining, mlm or classification")
    h, v = c.hidden_size, c.vocab_size
    layer = layer_parameters(h, c.ffn_size, c.num_attention_heads, c.num_attention_heads, bias=True, gated=False,
                             norm_params=2 * h)
    n = v * h + (c.max_position_embeddings + c.type_vocab_size) * h + c.num_layers * layer + 2 * h
    if head in ("pretraining", "mlm"):
        n += h * h + h + 2 * h + v + (0 if c.tie_word_embeddings else v * h)  # MLM transform, its norm, bias
    if head in ("pretraining", "classification"):
        n += h * h + h  # pooler
    return n + (2 * h + 2 if head == "pretraining" else h * c.num_labels + c.num_labels if head == "classification"
                else 0)


_UNTIED = ("tie_word_embeddings=False in a BERT with an MLM head (Hugging Face then keeps two output biases and "
           "uses one); tpzoo converts tied ones")


def _config_from_hf(hf: Any, arch: str) -> TransformerConfig:
    """The TransformerConfig of a BertConfig (dropout probabilities included)."""
    require(not hf.is_decoder and not hf.add_cross_attention, "is_decoder / add_cross_attention (a BERT decoder)")
    require(getattr(hf, "position_embedding_type", "absolute") == "absolute", "relative position embeddings")
    require(hf.tie_word_embeddings or is_classifier(arch), _UNTIED)
    return TransformerConfig(
        model_type="bert", num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings, type_vocab_size=hf.type_vocab_size,
        hidden_dropout=hf.hidden_dropout_prob, attention_dropout=hf.attention_probs_dropout_prob,
        layernorm_epsilon=hf.layer_norm_eps, layernorm_position="post", activation=gelu_from_hf(hf.hidden_act),
        tie_word_embeddings=hf.tie_word_embeddings, init_method_std=hf.initializer_range, **labels_from_hf(hf, arch))


def _config_to_hf(c: TransformerConfig, arch: str) -> Any:
    """The BertConfig of a TransformerConfig, naming ``arch`` as its architecture."""
    return transformers_module().BertConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads, intermediate_size=c.ffn_size, hidden_act=gelu_to_hf(c.activation),
        hidden_dropout_prob=c.hidden_dropout, attention_probs_dropout_prob=c.attention_dropout,
        max_position_embeddings=c.max_position_embeddings, type_vocab_size=c.type_vocab_size,
        initializer_range=c.init_method_std, layer_norm_eps=c.layernorm_epsilon,
        tie_word_embeddings=c.tie_word_embeddings, architectures=[arch], **labels_to_hf(c, arch))


def _rules(c: TransformerConfig, arch: str) -> list[Rule]:
    """The tensors of ``arch``: q, k, v as three Linears; the MLM decoder (weight and bias) tied."""
    lm = not is_classifier(arch)
    e, p = "bert.embeddings.", "cls.predictions."
    rules = [tied("embedding.word_embeddings.weight", f"{e}word_embeddings.weight",
                  *((f"{p}decoder.weight",) if lm else ())),
             same("embedding.position_embeddings.weight", f"{e}position_embeddings.weight"),
             same("embedding.token_type_embeddings.weight", f"{e}token_type_embeddings.weight"),
             *linear("embedding.layernorm", f"{e}LayerNorm")]
    for i in range(c.num_layers):
        t, h = f"layers.{i}.", f"bert.encoder.layer.{i}."
        rules += [qkv(f"{t}self_attention.query_key_value.{x}",
                      tuple(f"{h}attention.self.{proj}.{x}" for proj in ("query", "key", "value")),
                      c.num_attention_heads) for x in ("weight", "bias")]
        rules += [*linear(f"{t}self_attention.dense", f"{h}attention.output.dense"),
                  *linear(f"{t}attention_norm", f"{h}attention.output.LayerNorm"),
                  *linear(f"{t}mlp.dense_h_to_4h", f"{h}intermediate.dense"),
                  *linear(f"{t}mlp.dense_4h_to_h", f"{h}output.dense"),
                  *linear(f"{t}mlp_norm", f"{h}output.LayerNorm")]
    if arch in ("BertForPreTraining", "BertForSequenceClassification"):
        rules += linear("head.pooler.dense", "bert.pooler.dense")
    if not lm:
        return rules + linear("head.classifier", "classifier")
    require(c.tie_word_embeddings, _UNTIED)
    rules += [*linear("head.lm_head.dense", f"{p}transform.dense"),
              *linear("head.lm_head.layernorm", f"{p}transform.LayerNorm"),
              tied("head.lm_head.output_bias.bias", f"{p}bias", f"{p}decoder.bias")]
    if arch == "BertForPreTraining":
        rules += linear("head.binary_head", "cls.seq_relationship")
    return rules


HF = HFAdapter("bert", {"BertForPreTraining": ("BertModel", {"add_binary_head": True}),
                         "BertForMaskedLM": ("BertModel", {"add_binary_head": False}),
                         "BertForSequenceClassification": ("BertForSequenceClassification", {})},
                _config_from_hf, _config_to_hf, _rules)

