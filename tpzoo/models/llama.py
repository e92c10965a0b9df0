"""Llama (Touvron et al. 2023): rotary positions, grouped-query attention, SwiGLU, RMSNorm before each
sublayer and at the end, no biases, an output layer of its own; the block library's decoder
(``CausalLM``) built from a ``LlamaConfig``, split by ``DECODER_PLAN``.

    model = LlamaModel(get_preset("llama-1b"))   # plain PyTorch, one device
    loss = model(input_ids, labels=labels)       # [b, s] per-token loss (see ``CausalLM``)

Tensor parallelism splits the kv heads too: tp must divide ``num_query_groups`` (a clear error
otherwise). Hugging Face ``LlamaForCausalLM`` converts both ways (``tpzoo.convert``).
"""

from __future__ import annotations

from typing import Any

from tpzoo.models.causal_lm import CausalLM
from tpzoo.models.config import LlamaConfig
from tpzoo.models.families import FamilySpec, HFAdapter
from tpzoo.models.hf_rules import Rule, gated, qkv, require, same, tied, transformers_module
from tpzoo.models.presets import layer_parameters


class LlamaModel(CausalLM):
    """Llama: ``embedding`` (words only), ``layers`` (pre-RMSNorm, rotary GQA, SwiGLU), ``head``
    (final RMSNorm, output layer)."""

    model_type = "llama"
    config_class = LlamaConfig


def num_parameters(c: LlamaConfig, head: str | None = None) -> int:
    """Parameters of LlamaForCausalLM of this config (``head``: "lm", the only one)."""
    if head not in (None, "lm"):
        raise ValueError(f"head {head!r} does not apply to a llama config; choose 'lm'")
    h = c.hidden_size
    layer = layer_parameters(h, c.ffn_size, c.num_attention_heads, c.query_groups, bias=False, gated=True,
                             norm_params=h)
    return c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + c.num_layers * layer + h


# ------------------------------------------------------------------ Hugging Face LlamaForCausalLM

def _config_from_hf(hf: Any, arch: str) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face one; biases, scaled RoPE, other activations or head sizes are refused."""
    scaling = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope = dict(scaling)
    theta = rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))  # transformers 5 keeps it in rope_parameters
    require(rope.pop("rope_type", rope.pop("type", "default")) == "default" and not rope,
            f"rope_scaling={scaling!r} (scaled rotary positions)")
    for flag in ("attention_bias", "mlp_bias"):
        require(not getattr(hf, flag, False), f"{flag}=True")
    require(hf.hidden_act == "silu", f"hidden_act={hf.hidden_act!r} (tpzoo's Llama MLP is SwiGLU: silu)")
    head_dim = getattr(hf, "head_dim", None)
    require(head_dim in (None, hf.hidden_size // hf.num_attention_heads),
            f"head_dim={head_dim} (tpzoo's is hidden_size / num_attention_heads = "
            f"{hf.hidden_size // hf.num_attention_heads})")
    return LlamaConfig(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                       num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
                       ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
                       max_position_embeddings=hf.max_position_embeddings, attention_dropout=hf.attention_dropout,
                       layernorm_epsilon=hf.rms_norm_eps, tie_word_embeddings=hf.tie_word_embeddings,
                       init_method_std=hf.initializer_range, rotary_base=float(theta))


def _config_to_hf(c: LlamaConfig, arch: str) -> Any:
    return transformers_module().LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads, num_key_value_heads=c.query_groups,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon, rope_theta=c.rotary_base,
        tie_word_embeddings=c.tie_word_embeddings, attention_dropout=c.attention_dropout,
        initializer_range=c.init_method_std, architectures=[arch])


def _rules(c: LlamaConfig, arch: str) -> list[Rule]:
    """LlamaForCausalLM's tensors: q/k/v fused group by group, gate/up interleaved, q and k rows unpermuted
    (Hugging Face's weights are in the half-rotation layout already)."""
    rules = [tied("embedding.word_embeddings.weight", "model.embed_tokens.weight",
                  *(("lm_head.weight",) if c.tie_word_embeddings else ()))]
    for i in range(c.num_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        rules += [same(f"{t}attention_norm.weight", f"{h}input_layernorm.weight"),
                  qkv(f"{t}self_attention.query_key_value.weight",
                      tuple(f"{h}self_attn.{x}_proj.weight" for x in "qkv"), c.num_attention_heads, c.query_groups),
                  same(f"{t}self_attention.dense.weight", f"{h}self_attn.o_proj.weight"),
                  same(f"{t}mlp_norm.weight", f"{h}post_attention_layernorm.weight"),
                  gated(f"{t}mlp.dense_h_to_4h.weight", f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"),
                  same(f"{t}mlp.dense_4h_to_h.weight", f"{h}mlp.down_proj.weight")]
    rules.append(same("head.final_layernorm.weight", "model.norm.weight"))
    return rules + ([] if c.tie_word_embeddings else [same("head.output_layer.weight", "lm_head.weight")])


SPEC = FamilySpec(models={"LlamaModel": LlamaModel}, pretrain_model="LlamaModel",
                  finetune_model="LlamaModel", num_parameters=num_parameters,
                  hf=HFAdapter("llama", {"LlamaForCausalLM": ("LlamaModel", {})}, _config_from_hf, _config_to_hf,
                               _rules))
