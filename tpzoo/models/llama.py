"""Llama (Touvron et al. 2023) from the blocks: rotary positions, grouped-query attention, SwiGLU,
RMSNorm before each sublayer and at the end, no biases, an output layer of its own.

    model = LlamaModel(get_preset("llama-1b"), plan)
    logits = model(input_ids)                  # [b, s, V] over the real vocabulary (gathered)
    loss = model(input_ids, labels=labels)     # [b, s] per-token loss (see ``CausalLM``)

Tensor parallelism splits the kv heads too: tp must divide ``num_query_groups`` (a clear error
otherwise). Hugging Face ``LlamaForCausalLM`` converts both ways (``tpzoo.convert``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tpzoo.models.attention import ParallelAttention
from tpzoo.models.causal_lm import CausalLM
from tpzoo.models.config import ModelConfig, _choice, _field, _int, _optional, _positive_float
from tpzoo.models.embedding import Embedding
from tpzoo.models.families import FamilySpec, HFAdapter
from tpzoo.models.hf_rules import Rule, gated, qkv, require, same, tied, transformers_module
from tpzoo.models.mlp import ParallelMLP
from tpzoo.models.presets import layer_parameters
from tpzoo.models.rope import RotaryEmbedding
from tpzoo.models.transformer import TransformerLayer


@dataclass
class LlamaConfig(ModelConfig):
    """A Llama-family decoder; ``layernorm_epsilon`` is RMSNorm's epsilon (Hugging Face's rms_norm_eps)."""

    model_type: str = _field("llama", _choice("llama"), "llama")
    hidden_dropout: float = _field(0.0, ModelConfig.__dataclass_fields__["hidden_dropout"].metadata["check"],
                                   "dropout on embeddings and residual branches (Llama: none)")
    attention_dropout: float = _field(0.0, ModelConfig.__dataclass_fields__["attention_dropout"].metadata["check"],
                                      "dropout on attention probabilities (Llama: none)")
    tie_word_embeddings: bool = _field(False, ModelConfig.__dataclass_fields__["tie_word_embeddings"].metadata["check"],
                                       "output layer shares the word embedding weight (Llama: its own)")
    num_query_groups: int | None = _field(None, _optional(_int(1)),
                                          "key/value heads g (grouped-query attention); None: one per head")
    rotary_base: float = _field(10000.0, _positive_float, "rotary base theta (Hugging Face's rope_theta)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by num_query_groups="
                             f"{self.query_groups}: each kv head serves an equal share of the query heads")

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """``ffn_hidden_size``, or Llama's 2/3 x 4h rounded up to a multiple of 256 when None."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return -(-(8 * self.hidden_size // 3) // 256) * 256


class LlamaModel(CausalLM):
    """Llama: ``embedding`` (words only), ``layers`` (pre-RMSNorm, rotary GQA, SwiGLU), ``head``
    (final RMSNorm, output layer)."""

    model_type = "llama"
    config_class = LlamaConfig
    norm_kind = "rmsnorm"

    def build_embedding(self) -> nn.Module:
        c = self.config
        return Embedding(c.vocab_size, c.hidden_size, self.plan, hidden_dropout=c.hidden_dropout,
                         init_std=c.init_method_std, max_sequence=c.max_position_embeddings,
                         pad_to=c.make_vocab_size_divisible_by)

    def build_layer(self, layer_number: int) -> nn.Module:
        c, plan = self.config, self.plan
        rotary = RotaryEmbedding(c.head_dim, c.rotary_base, c.max_position_embeddings)
        attention = ParallelAttention(c.hidden_size, c.num_attention_heads, plan, num_query_groups=c.query_groups,
                                      causal=self.causal, bias=False, attention_dropout=c.attention_dropout,
                                      init_std=c.init_method_std, output_init_std=c.init_method_std,
                                      rotary=rotary, layer_number=layer_number)
        mlp = ParallelMLP(c.hidden_size, c.ffn_size, plan, activation="swiglu", bias=False,
                          init_std=c.init_method_std, output_init_std=c.init_method_std)
        return TransformerLayer(attention, mlp, self.norm(), self.norm(), plan, hidden_dropout=c.hidden_dropout)



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


SPEC = FamilySpec(config_class=LlamaConfig, models={"LlamaModel": LlamaModel}, pretrain_model="LlamaModel",
                  finetune_model="LlamaModel", num_parameters=num_parameters,
                  hf=HFAdapter("llama", {"LlamaForCausalLM": ("LlamaModel", {})}, _config_from_hf, _config_to_hf,
                               _rules))
