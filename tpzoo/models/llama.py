"""Llama (Touvron et al. 2023): rotary positions, grouped-query attention, SwiGLU, RMSNorm before each
sublayer and at the end, no biases, an output layer of its own; the block library's decoder
(``CausalLM``) built from a ``LlamaConfig``, split by ``DECODER_PLAN``.

    model = LlamaModel(get_preset("llama-1b"))   # plain PyTorch, one device
    loss = model(input_ids, labels=labels)       # [b, s] per-token loss (see ``CausalLM``)
    clf = LlamaForSequenceClassification(config) # a classifier read at the last real token (``SequenceClassifier``)

Tensor parallelism splits the kv heads too: tp must divide ``num_query_groups`` (a clear error
otherwise). Hugging Face ``LlamaForCausalLM`` and ``LlamaForSequenceClassification`` convert both ways
(``tpzoo.convert``), Llama 3.x's scaled
rotary positions included; the Llama-like families (``tpzoo.models.qwen2``, ``qwen3``, ``mistral``) convert
with this module's ``config_from_hf``, ``config_to_hf`` and ``rules``.
"""

from __future__ import annotations

from typing import Any, Callable

from tpzoo.models.causal_lm import CausalLM, SequenceClassifier
from tpzoo.models.config import LlamaConfig
from tpzoo.models.families import FamilySpec, HFAdapter
from tpzoo.models.hf_rules import (Rule, gated, is_classifier, labels_from_hf, labels_to_hf, qkv, require, same, tied,
                                   transformers_module)
from tpzoo.models.presets import layer_parameters


class LlamaModel(CausalLM):
    """Llama: ``embedding`` (words only), ``layers`` (pre-RMSNorm, rotary GQA, SwiGLU), ``head``
    (final RMSNorm, output layer)."""

    model_type = "llama"
    config_class = LlamaConfig


class LlamaForSequenceClassification(SequenceClassifier, LlamaModel):
    """Llama as a classifier (Hugging Face's LlamaForSequenceClassification): ``score`` at the last real token."""


def num_parameters(c: LlamaConfig, head: str | None = None) -> int:
    """Parameters of the ``...ForCausalLM`` of this Llama-like config (``head`` "lm", the default) or of its
    ``...ForSequenceClassification`` (``head`` "classification")."""
    if head not in (None, "lm", "classification"):
        raise ValueError(f"head {head!r} does not apply to a {c.model_type} config; choose 'lm' or 'classification'")
    h, d = c.hidden_size, c.head_dim
    layer = layer_parameters(h, c.ffn_size, c.num_attention_heads, c.query_groups, bias=False, gated=True,
                             norm_params=h, head_dim=d)
    layer += (c.num_attention_heads + 2 * c.query_groups) * d * c.add_qkv_bias + 2 * d * c.qk_layernorm
    out = c.num_labels * h if head == "classification" else 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.vocab_size * h + out + c.num_layers * layer + h


# ------------------------------------------------------------------ Hugging Face LlamaForCausalLM
# The Llama-like families (Qwen2, Qwen3, Mistral) convert with these too, each adding its own checks and fields.

def rope_from_hf(hf: Any) -> dict[str, Any]:
    """The rotary fields of a LlamaConfig from a Hugging Face config: the base, and Llama 3.x's scaling (the one
    scaled kind tpzoo turns); other kinds are refused."""
    given = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope = dict(given)
    fields: dict[str, Any] = dict(rotary_base=float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    if kind == "llama3":
        names = dict(factor="rope_scaling_factor", low_freq_factor="rope_low_freq_factor",
                     high_freq_factor="rope_high_freq_factor", original_max_position_embeddings="rope_original_max_positions")
        require(set(names) <= set(rope), f"rope_scaling={given!r} (llama3 needs {', '.join(names)})")
        fields.update(rope_scaling=True, **{ours: rope.pop(theirs) for theirs, ours in names.items()})
    require(kind in ("default", "llama3") and not rope,
            f"rope_scaling={given!r} (tpzoo turns plain rotary positions and Llama 3.x's rope_type llama3)")
    return fields


def rope_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """``rope_from_hf``'s inverse, as Hugging Face configs of transformers 4 and 5 both take it."""
    scaling = None
    if c.rope_scaling:
        scaling = dict(rope_type="llama3", factor=c.rope_scaling_factor, low_freq_factor=c.rope_low_freq_factor,
                       high_freq_factor=c.rope_high_freq_factor,
                       original_max_position_embeddings=c.rope_original_max_positions)
    return dict(rope_theta=c.rotary_base, rope_scaling=scaling)


def config_from_hf(hf: Any, arch: str, config_class: type[LlamaConfig] = LlamaConfig, **own: Any) -> LlamaConfig:
    """The ``config_class`` of a Llama-like Hugging Face config of class ``arch``: the fields they share, the rotary
    ones (``rope_from_hf``), the head size, a classifier's classes and ``own`` (the family's); a non-SwiGLU MLP is
    refused."""
    require(hf.hidden_act == "silu", f"hidden_act={hf.hidden_act!r} (tpzoo's Llama MLP is SwiGLU: silu)")
    return config_class(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                        num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
                        ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
                        max_position_embeddings=hf.max_position_embeddings, attention_dropout=hf.attention_dropout,
                        layernorm_epsilon=hf.rms_norm_eps, tie_word_embeddings=hf.tie_word_embeddings,
                        init_method_std=hf.initializer_range, kv_channels=getattr(hf, "head_dim", None),
                        **rope_from_hf(hf), **labels_from_hf(hf, arch), **own)


def config_to_hf(c: LlamaConfig, hf_config: str, arch: str, **own: Any) -> Any:
    """The Hugging Face config (class ``hf_config`` of transformers) of a Llama-like config, with ``own`` fields."""
    return getattr(transformers_module(), hf_config)(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads, num_key_value_heads=c.query_groups,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon,
        tie_word_embeddings=c.tie_word_embeddings, attention_dropout=c.attention_dropout,
        initializer_range=c.init_method_std, architectures=[arch], **rope_to_hf(c), **labels_to_hf(c, arch), **own)


def rules(c: LlamaConfig, arch: str) -> list[Rule]:
    """The tensors of a Llama-like ``...ForCausalLM`` (or ``...ForSequenceClassification``: ``score``, no LM head):
    q/k/v (and their biases with ``add_qkv_bias``) fused group by group, gate/up interleaved, the query and key norms
    with ``qk_layernorm``; q and k rows unpermuted (Hugging Face's weights are in the half-rotation layout already)."""
    lm = not is_classifier(arch)
    out = [tied("embedding.word_embeddings.weight", "model.embed_tokens.weight",
                *(("lm_head.weight",) if c.tie_word_embeddings and lm else ()))]
    for i in range(c.num_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        attention = [qkv(f"{t}self_attention.query_key_value.{p}", tuple(f"{h}self_attn.{x}_proj.{p}" for x in "qkv"),
                         c.num_attention_heads, c.query_groups)
                     for p in ("weight", "bias")[:2 if c.add_qkv_bias else 1]]
        if c.qk_layernorm:
            attention += [same(f"{t}self_attention.{x}_norm.weight", f"{h}self_attn.{x}_norm.weight") for x in "qk"]
        out += [same(f"{t}attention_norm.weight", f"{h}input_layernorm.weight"), *attention,
                same(f"{t}self_attention.dense.weight", f"{h}self_attn.o_proj.weight"),
                same(f"{t}mlp_norm.weight", f"{h}post_attention_layernorm.weight"),
                gated(f"{t}mlp.dense_h_to_4h.weight", f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"),
                same(f"{t}mlp.dense_4h_to_h.weight", f"{h}mlp.down_proj.weight")]
    out.append(same("head.final_layernorm.weight", "model.norm.weight"))
    if not lm:
        return out + [same("head.score.weight", "score.weight")]
    return out + ([] if c.tie_word_embeddings else [same("head.output_layer.weight", "lm_head.weight")])


def _llama_from_hf(hf: Any, arch: str) -> LlamaConfig:
    """Biases (Llama's attention_bias also puts one on o_proj) are refused."""
    for flag in ("attention_bias", "mlp_bias"):
        require(not getattr(hf, flag, False), f"{flag}=True")
    return config_from_hf(hf, arch)


def llama_like_spec(model: type[CausalLM], classifier: type[CausalLM], hf_config: str,
                    config_from: Callable[[Any, str], LlamaConfig], *, to_hf: Callable[[Any, str], Any] | None = None,
                    count: Callable[..., int] = num_parameters, hf_rules: Callable[..., list[Rule]] = rules,
                    **own_to_hf: Callable[[LlamaConfig], Any]) -> FamilySpec:
    """The ``FamilySpec`` of a Llama-like family: its decoder ``model`` and its ``classifier``, the parameter
    ``count`` and ``hf_rules`` (Llama's unless given), Hugging Face's ``<Name>ForCausalLM`` and
    ``<Name>ForSequenceClassification`` of config class ``hf_config``, read by ``config_from`` and written by
    ``to_hf`` (default: Llama's fields and ``own_to_hf``, Hugging Face field -> its value of a config)."""
    name, hf_name = model.__name__, hf_config.removesuffix("Config")
    to_hf = to_hf or (lambda c, arch: config_to_hf(c, hf_config, arch, **{k: f(c) for k, f in own_to_hf.items()}))
    archs = {f"{hf_name}ForCausalLM": (name, {}), f"{hf_name}ForSequenceClassification": (classifier.__name__, {})}
    return FamilySpec(models={name: model, classifier.__name__: classifier}, pretrain_model=name,
                      finetune_model=name, classifier_model=classifier.__name__, num_parameters=count,
                      hf=HFAdapter(model.model_type, archs, config_from, to_hf, hf_rules))


SPEC = llama_like_spec(LlamaModel, LlamaForSequenceClassification, "LlamaConfig", _llama_from_hf)
