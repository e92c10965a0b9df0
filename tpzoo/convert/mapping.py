"""Hugging Face <-> tpzoo, on full (unsharded) state dicts and configs: pure functions, no process group.

Every tpzoo tensor is one rule: its name, the Hugging Face names it comes from, and the two
exact (bitwise) transforms between them. The layouts that differ:

- fused QKV: tpzoo keeps [3h, h] head by head ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...], d rows each,
  so that a tp shard holds whole heads); GPT-2 keeps [q; k; v] in one Conv1D, BERT three Linears.
- GPT-2's Conv1D stores weights [in, out]; tpzoo (like nn.Linear) [out, in]: transposed.
- tied weights (GPT-2's lm_head, BERT's decoder weight and bias) are one tensor in tpzoo and
  are written back under both Hugging Face names.

Supported: GPT2LMHeadModel <-> GPTModel, BertForPreTraining <-> BertModel,
BertForMaskedLM <-> BertModel(add_binary_head=False), BertForSequenceClassification <->
BertForSequenceClassification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from tpzoo.models.config import TransformerConfig

# Hugging Face architecture -> (tpzoo class, its options)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "GPT2LMHeadModel": ("GPTModel", {}),
    "BertForPreTraining": ("BertModel", {"add_binary_head": True}),
    "BertForMaskedLM": ("BertModel", {"add_binary_head": False}),
    "BertForSequenceClassification": ("BertForSequenceClassification", {}),
}
_UNTIED_BERT = ("tie_word_embeddings=False in a BERT with an MLM head (Hugging Face then keeps two output "
                "biases and uses one); tpzoo converts tied ones")
_ACTIVATIONS_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


class ConversionError(ValueError):
    """A checkpoint or config that tpzoo cannot represent exactly."""


def architecture_of(class_name: str, options: dict[str, Any]) -> str:
    """The Hugging Face architecture of a tpzoo model class with ``options``."""
    for arch, (cls, opts) in ARCHITECTURES.items():
        if cls == class_name and all(options.get(k) == v for k, v in opts.items()):
            return arch
    raise ConversionError(f"no Hugging Face architecture for tpzoo {class_name} with {options}")


# ----------------------------------------------------------------------------------------- configs

def _activation(name: str) -> str:
    if name not in _ACTIVATIONS_FROM_HF:
        raise ConversionError(f"activation {name!r} has no tpzoo equivalent; supported: {sorted(_ACTIVATIONS_FROM_HF)}")
    return _ACTIVATIONS_FROM_HF[name]


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ConversionError(f"unsupported Hugging Face config: {what}")


def config_from_hf(hf: Any, arch: str) -> TransformerConfig:
    """TransformerConfig of a GPT2Config / BertConfig (dropout probabilities included)."""
    if arch.startswith("GPT2"):
        _require(hf.scale_attn_weights, "scale_attn_weights=False")
        _require(not hf.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=True")
        _require(not hf.add_cross_attention, "add_cross_attention=True")
        return TransformerConfig(
            model_type="gpt", num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head,
            ffn_hidden_size=hf.n_inner, vocab_size=hf.vocab_size, max_position_embeddings=hf.n_positions,
            hidden_dropout=hf.resid_pdrop, attention_dropout=hf.attn_pdrop, layernorm_epsilon=hf.layer_norm_epsilon,
            layernorm_position="pre", activation=_activation(hf.activation_function),
            tie_word_embeddings=hf.tie_word_embeddings, init_method_std=hf.initializer_range)
    _require(not hf.is_decoder and not hf.add_cross_attention, "is_decoder / add_cross_attention (a BERT decoder)")
    _require(getattr(hf, "position_embedding_type", "absolute") == "absolute", "relative position embeddings")
    _require(hf.problem_type in (None, "single_label_classification"), f"problem_type={hf.problem_type!r}")
    _require(hf.tie_word_embeddings or arch == "BertForSequenceClassification", _UNTIED_BERT)
    _require(hf.num_labels >= 2 or arch != "BertForSequenceClassification", "num_labels=1 (regression)")
    return TransformerConfig(
        model_type="bert", num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings, type_vocab_size=hf.type_vocab_size,
        hidden_dropout=hf.hidden_dropout_prob, attention_dropout=hf.attention_probs_dropout_prob,
        layernorm_epsilon=hf.layer_norm_eps, layernorm_position="post", activation=_activation(hf.hidden_act),
        tie_word_embeddings=hf.tie_word_embeddings, init_method_std=hf.initializer_range,
        num_labels=max(hf.num_labels, 2))


def config_to_hf(config: TransformerConfig, arch: str) -> Any:
    """The GPT2Config / BertConfig of a TransformerConfig, naming ``arch`` as its architecture."""
    import transformers

    act = "gelu_new" if config.activation == "gelu_tanh" else "gelu"
    if config.model_type == "gpt":
        return transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
            n_layer=config.num_layers, n_head=config.num_attention_heads, n_inner=config.ffn_hidden_size,
            activation_function=act, resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
            attn_pdrop=config.attention_dropout, layer_norm_epsilon=config.layernorm_epsilon,
            initializer_range=config.init_method_std, tie_word_embeddings=config.tie_word_embeddings,
            bos_token_id=config.vocab_size - 1, eos_token_id=config.vocab_size - 1, architectures=[arch])
    return transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, intermediate_size=config.ffn_size, hidden_act=act,
        hidden_dropout_prob=config.hidden_dropout, attention_probs_dropout_prob=config.attention_dropout,
        max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
        initializer_range=config.init_method_std, layer_norm_eps=config.layernorm_epsilon,
        tie_word_embeddings=config.tie_word_embeddings, num_labels=config.num_labels, architectures=[arch])


# ------------------------------------------------------------------------------------ state dicts

@dataclass(frozen=True)
class Rule:
    """tpzoo tensor ``tpzoo`` = ``to_tpzoo(*hf tensors)``; the hf tensors = ``to_hf(tpzoo tensor)``.

    ``tied``: the hf names all hold the same tensor (only the first need be present).
    """

    tpzoo: str
    hf: tuple[str, ...]
    to_tpzoo: Callable[..., Tensor]
    to_hf: Callable[[Tensor], tuple[Tensor, ...]]
    tied: bool = False


def _same(tpzoo: str, hf: str, transpose: bool = False) -> Rule:
    move = (lambda t: t.t().contiguous()) if transpose else (lambda t: t.clone())
    return Rule(tpzoo, (hf,), move, lambda t: (move(t),))


def _linear(ours: str, theirs: str) -> list[Rule]:
    return [_same(f"{ours}.{p}", f"{theirs}.{p}") for p in ("weight", "bias")]


def _tied(tpzoo: str, *hf: str) -> Rule:
    return Rule(tpzoo, hf, lambda t: t.clone(), lambda t: tuple(t.clone() for _ in hf), tied=True)


def heads_from_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
    """[q; k; v] (each [h, ...], heads contiguous) -> [3h, ...] laid out [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    rest = q.shape[1:]
    return torch.stack((q, k, v)).view(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def qkv_from_heads(w: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``heads_from_qkv``."""
    rest = w.shape[1:]
    q, k, v = w.view(heads, 3, -1, *rest).transpose(0, 1).reshape(3, -1, *rest)
    return q.clone(), k.clone(), v.clone()


def _gpt2_rules(c: TransformerConfig) -> list[Rule]:
    n = c.num_attention_heads
    rules = [_tied("embedding.word_embeddings.weight", "transformer.wte.weight",
                   *(("lm_head.weight",) if c.tie_word_embeddings else ())),
             _same("embedding.position_embeddings.weight", "transformer.wpe.weight")]
    for i in range(c.num_layers):
        t, h = f"layers.{i}.", f"transformer.h.{i}."
        rules += [*_linear(f"{t}attention_norm", f"{h}ln_1"), *_linear(f"{t}mlp_norm", f"{h}ln_2"),
                  # Conv1D c_attn: weight [h, 3h] = [W_q W_k W_v]^T, bias [3h]
                  Rule(f"{t}self_attention.query_key_value.weight", (f"{h}attn.c_attn.weight",),
                       lambda w: heads_from_qkv(*w.t().chunk(3), heads=n),
                       lambda w: (torch.cat(qkv_from_heads(w, n)).t().contiguous(),)),
                  Rule(f"{t}self_attention.query_key_value.bias", (f"{h}attn.c_attn.bias",),
                       lambda b: heads_from_qkv(*b.chunk(3), heads=n),
                       lambda b: (torch.cat(qkv_from_heads(b, n)),))]
        for ours, theirs in (("self_attention.dense", "attn.c_proj"), ("mlp.dense_h_to_4h", "mlp.c_fc"),
                             ("mlp.dense_4h_to_h", "mlp.c_proj")):
            rules += [_same(f"{t}{ours}.weight", f"{h}{theirs}.weight", transpose=True),
                      _same(f"{t}{ours}.bias", f"{h}{theirs}.bias")]
    rules += _linear("head.final_layernorm", "transformer.ln_f")
    if not c.tie_word_embeddings:
        rules.append(_same("head.output_layer.weight", "lm_head.weight"))
    return rules


def _bert_rules(c: TransformerConfig, arch: str) -> list[Rule]:
    n = c.num_attention_heads
    lm = arch != "BertForSequenceClassification"
    e, p = "bert.embeddings.", "cls.predictions."
    rules = [_tied("embedding.word_embeddings.weight", f"{e}word_embeddings.weight",
                   *((f"{p}decoder.weight",) if lm else ())),
             _same("embedding.position_embeddings.weight", f"{e}position_embeddings.weight"),
             _same("embedding.token_type_embeddings.weight", f"{e}token_type_embeddings.weight"),
             *_linear("embedding.layernorm", f"{e}LayerNorm")]
    for i in range(c.num_layers):
        t, h = f"layers.{i}.", f"bert.encoder.layer.{i}."
        rules += [Rule(f"{t}self_attention.query_key_value.{x}",
                       tuple(f"{h}attention.self.{proj}.{x}" for proj in ("query", "key", "value")),
                       lambda q, k, v: heads_from_qkv(q, k, v, heads=n), lambda w: qkv_from_heads(w, n))
                  for x in ("weight", "bias")]
        rules += [*_linear(f"{t}self_attention.dense", f"{h}attention.output.dense"),
                  *_linear(f"{t}attention_norm", f"{h}attention.output.LayerNorm"),
                  *_linear(f"{t}mlp.dense_h_to_4h", f"{h}intermediate.dense"),
                  *_linear(f"{t}mlp.dense_4h_to_h", f"{h}output.dense"),
                  *_linear(f"{t}mlp_norm", f"{h}output.LayerNorm")]
    if arch in ("BertForPreTraining", "BertForSequenceClassification"):
        rules += _linear("head.pooler.dense", "bert.pooler.dense")
    if not lm:
        return rules + _linear("head.classifier", "classifier")
    _require(c.tie_word_embeddings, _UNTIED_BERT)
    rules += [*_linear("head.lm_head.dense", f"{p}transform.dense"),
              *_linear("head.lm_head.layernorm", f"{p}transform.LayerNorm"),
              _tied("head.lm_head.output_bias.bias", f"{p}bias", f"{p}decoder.bias")]
    if arch == "BertForPreTraining":
        rules += _linear("head.binary_head", "cls.seq_relationship")
    return rules


def rules_for(config: TransformerConfig, arch: str) -> list[Rule]:
    """The conversion rules of one model: one per tpzoo tensor."""
    if arch not in ARCHITECTURES:
        raise ConversionError(f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return _gpt2_rules(config) if arch.startswith("GPT2") else _bert_rules(config, arch)


def _shown(names: list[str]) -> str:
    return f"{names[:6]}{' ...' if len(names) > 6 else ''}"


def state_dict_from_hf(hf_state: dict[str, Tensor], config: TransformerConfig, arch: str) -> dict[str, Tensor]:
    """Hugging Face state dict -> tpzoo full state dict (float32). Tied repeats may be absent, as in saved files."""
    rules = rules_for(config, arch)
    needed = {name for r in rules for name in (r.hf[:1] if r.tied else r.hf)}
    missing = sorted(needed - set(hf_state))
    if missing:
        raise ConversionError(f"the {arch} checkpoint lacks {_shown(missing)}")
    known = {name for r in rules for name in r.hf}
    extra = sorted(k for k in hf_state if k not in known and not k.endswith((".attn.bias", ".attn.masked_bias")))
    if extra:
        raise ConversionError(f"the {arch} checkpoint has tensors tpzoo has no place for: {_shown(extra)}")
    return {r.tpzoo: r.to_tpzoo(*(hf_state[k].detach().float() for k in (r.hf[:1] if r.tied else r.hf)))
            for r in rules}


def state_dict_to_hf(state: dict[str, Tensor], config: TransformerConfig, arch: str) -> dict[str, Tensor]:
    """tpzoo full state dict -> Hugging Face state dict, tied tensors under each of their names."""
    out: dict[str, Tensor] = {}
    for r in rules_for(config, arch):
        out.update(zip(r.hf, r.to_hf(state[r.tpzoo])))
    return out


def tied_repeats(config: TransformerConfig, arch: str) -> set[str]:
    """Hugging Face names that repeat a tied tensor: saved files leave them out, as Hugging Face does."""
    return {name for r in rules_for(config, arch) if r.tied for name in r.hf[1:]}
