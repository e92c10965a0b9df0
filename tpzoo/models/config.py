"""Model configs: what a model is (sizes and kinds of blocks), one validated dataclass per family.

``ModelConfig`` holds what every tpzoo transformer has (layers, widths, heads, vocabulary, dropout,
init) and the traits Megatron-LM's architecture flags name (positions, norm, MLP activation,
biases), which the models read to build themselves; each family's config narrows the traits to
what the family is and adds its own fields: ``TransformerConfig`` (GPT-2 and BERT) and ``LlamaConfig`` (and the
Llama-like ``Qwen2Config``, ``Qwen3Config``, ``MistralConfig``; ``MixtralConfig``: with mixtures of experts). How a
model runs (mesh, sequence parallelism, recompute, kernels, seed) is not config: it is the
``tpzoo.parallel.ParallelPlan`` applied to it.

Every field declares, next to it, its check, its meaning and the Megatron-LM flag that sets it
(``option(default, check, doc, flag)``); ``__post_init__`` runs the checks, then those that tie
fields together. Errors name the field and the value. Sizes that depend on the mesh (heads or ffn
not divisible by tp) are checked when a model is built for a mesh (``ShardingPlan.tp_divides``). A
config round-trips through a plain dict (``to_dict`` / ``from_dict``), which is what a checkpoint
stores; ``from_dict`` also reads the older layouts (run options inside, traits absent). This module
imports without torch: the training scripts check their flags against it before torch loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tpzoo.fields import (Check, at_least, boolean, check_fields, fraction, non_negative_number, one_of, option,
                          optional, positive_number)
from tpzoo.run_options import PLAN_OPTIONS

LAYERNORM_POSITIONS = ("pre", "post")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")  # Megatron-LM's --position-embedding-type
NORMALIZATIONS = ("LayerNorm", "RMSNorm")                # Megatron-LM's --normalization
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "geglu")   # MLP activations; --swiglu: swiglu
IGNORE_INDEX = -100  # a label no loss counts (a padded token, an unmasked MLM position, a sample without a label)
# run options that checkpoints written before ParallelPlan kept in the model config (read and dropped)
OLD_RUN_OPTIONS = frozenset(PLAN_OPTIONS) - {"compile", "fsdp"}
# fields that change how a model computes or was initialised, not which weights it holds: a checkpoint
# loads into (and a run resumes with) a config that differs from the saved one only in these (checkpoints
# store the vocabulary unpadded, so its padding multiple is one of them)
RUN_OPTIONS = frozenset({"hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by"})


def _narrowed(cls: type, name: str, default: Any, doc: str, check: Check | None = None) -> Any:
    """Field ``name`` of ``cls`` with another default, meaning and (optionally) check; the same flag."""
    meta = cls.__dataclass_fields__[name].metadata
    return option(default, check or meta["check"], doc, meta["flag"])


@dataclass
class ModelConfig:
    """What every tpzoo transformer has; a family's config subclasses it (see module docstring)."""

    model_type: str = option("", lambda v: None if isinstance(v, str) and v else f"must name a family, got {v!r}",
                             "the model family (tpzoo.models.families)")
    num_layers: int = option(12, at_least(1), "transformer layers", "--num-layers")
    hidden_size: int = option(768, at_least(1), "width h of the residual stream", "--hidden-size")
    num_attention_heads: int = option(12, at_least(1), "attention heads n; h / n features each",
                                      "--num-attention-heads")
    ffn_hidden_size: int | None = option(None, optional(at_least(1)),
                                         "MLP width f; None: the family's (GPT, BERT: 4 h)", "--ffn-hidden-size")
    vocab_size: int = option(50257, at_least(1), "real vocabulary V (padded inside: see make_vocab_size_divisible_by)")
    make_vocab_size_divisible_by: int = option(128, at_least(1), "the vocabulary is padded with unused rows to "
                                               "V' = a multiple of this x tp", "--make-vocab-size-divisible-by")
    max_position_embeddings: int = option(1024, at_least(1), "the longest sequence (learned positions: their count)",
                                          "--max-position-embeddings")
    hidden_dropout: float = option(0.1, fraction, "dropout on embeddings and residual branches", "--hidden-dropout")
    attention_dropout: float = option(0.1, fraction, "dropout on attention probabilities", "--attention-dropout")
    layernorm_epsilon: float = option(1e-5, positive_number, "epsilon of the norms (LayerNorm or RMSNorm)",
                                      "--norm-epsilon")
    tie_word_embeddings: bool = option(True, boolean, "output layer shares the word embedding weight (Megatron-LM: "
                                       "False with --untie-embeddings-and-output-weights)",
                                       "--untie-embeddings-and-output-weights")
    init_method_std: float = option(0.02, positive_number, "std of the normal weight init", "--init-method-std")
    num_labels: int = option(2, at_least(2), "classes of a sequence classifier (BertForSequenceClassification, "
                             "a decoder's ...ForSequenceClassification)")

    position_embedding_type: str = option("learned_absolute", one_of(*POSITION_EMBEDDING_TYPES),
                                          "learned_absolute: a learned position table; rope: rotary positions",
                                          "--position-embedding-type")
    normalization: str = option("LayerNorm", one_of(*NORMALIZATIONS), "the norms: LayerNorm or RMSNorm",
                                "--normalization")
    activation: str = option("gelu", one_of(*ACTIVATIONS), "MLP activation: gelu (erf), gelu_tanh, or gated "
                             "swiglu / geglu (Megatron-LM's --swiglu: swiglu)", "--swiglu")
    add_bias_linear: bool = option(True, boolean, "biases on the linear layers", "--add-bias-linear")
    add_qkv_bias: bool = option(False, boolean, "biases on the query, key and value projections, also without "
                                "add_bias_linear (Qwen2)", "--add-qkv-bias")
    qk_layernorm: bool = option(False, boolean, "a norm (the model's normalization) over each head's queries and "
                                "keys before rotary positions turn them (Qwen3)", "--qk-layernorm")
    kv_channels: int | None = option(None, optional(at_least(1)), "features d of each attention head; None: "
                                     "hidden_size / num_attention_heads (a value equal to that is kept as None)",
                                     "--kv-channels")
    window_size: int | None = option(None, optional(at_least(1)), "sliding-window attention: each token sees "
                                     "itself and the window_size - 1 tokens before it (Hugging Face's "
                                     "sliding_window; Megatron-LM's --window-size L,0 is L + 1); None: all before it",
                                     "--window-size")

    def __post_init__(self) -> None:
        if self.kv_channels is not None and self.kv_channels * self.num_attention_heads == self.hidden_size:
            self.kv_channels = None  # one spelling of the default head size: configs compare equal
        check_fields(self)  # a subclass's plain fields (no check) are taken as they are
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}: each head gets hidden_size / num_attention_heads "
                             f"features; choose a multiple of {self.num_attention_heads} or set kv_channels")

    @property
    def ffn_size(self) -> int:
        """The MLP width: ``ffn_hidden_size``, or 4 x hidden_size when that is None."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """d: ``kv_channels``, or hidden_size / num_attention_heads when that is None."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups`` where the family has it and it is set, else one per head."""
        return getattr(self, "num_query_groups", None) or self.num_attention_heads

    def size(self, name: str) -> int:
        """The size field ``name`` as the model is built: ``ffn_hidden_size`` and ``num_query_groups`` are
        their family's defaults where None (``ffn_size``, ``query_groups``)."""
        resolved = {"ffn_hidden_size": self.ffn_size, "num_query_groups": self.query_groups}
        return resolved[name] if name in resolved else getattr(self, name)

    @classmethod
    def flag_fields(cls) -> dict[str, dataclasses.Field]:
        """The fields that a command-line flag of their own name sets (``--num-layers`` -> ``num_layers``; the
        flags Megatron-LM spells otherwise, such as ``--norm-epsilon``, are the architecture flags')."""
        return {f.name: f for f in dataclasses.fields(cls)
                if f.metadata.get("flag") == f"--{f.name.replace('_', '-')}" and hasattr(f.metadata["check"], "parse")}

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied and validated (e.g. command-line overrides of a preset)."""
        unknown = sorted(set(changes) - set(field_names(type(self))))
        if unknown:
            raise ValueError(f"unknown {type(self).__name__} field(s) {unknown}; known: {field_names(type(self))}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of ``to_dict``; missing fields take their defaults, unknown ones raise. The run options
        of the older layout (``OLD_RUN_OPTIONS``, now the ``ParallelPlan``'s) are dropped."""
        data = {k: v for k, v in data.items() if k not in OLD_RUN_OPTIONS}
        unknown = sorted(set(data) - set(field_names(cls)))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known: {field_names(cls)}")
        return cls(**data)


@dataclass
class TransformerConfig(ModelConfig):
    """GPT-2 and BERT: learned positions, LayerNorm, GELU MLP with biases (see docs/models.md)."""

    model_type: str = option("gpt", one_of("gpt", "bert"), "gpt (causal, pre-LN) or bert (bidirectional, post-LN)")
    type_vocab_size: int = option(0, at_least(0), "token types (BERT segments); 0 for none")
    layernorm_position: str = option("pre", one_of(*LAYERNORM_POSITIONS),
                                     "pre: x + f(LN(x)) and a final LN (GPT); post: LN(x + f(x)) (BERT)")
    position_embedding_type: str = _narrowed(ModelConfig, "position_embedding_type", "learned_absolute",
                                             "learned absolute positions", one_of("learned_absolute"))
    normalization: str = _narrowed(ModelConfig, "normalization", "LayerNorm", "LayerNorm", one_of("LayerNorm"))
    activation: str = _narrowed(ModelConfig, "activation", "gelu_tanh", "MLP activation: gelu (erf) or gelu_tanh",
                                one_of("gelu", "gelu_tanh"))
    add_bias_linear: bool = _narrowed(ModelConfig, "add_bias_linear", True, "biases on every linear layer",
                                      one_of(True))
    add_qkv_bias: bool = _narrowed(ModelConfig, "add_qkv_bias", False, "(biases on every linear layer already)",
                                   one_of(False))
    qk_layernorm: bool = _narrowed(ModelConfig, "qk_layernorm", False, "no query/key norm", one_of(False))
    kv_channels: int | None = _narrowed(ModelConfig, "kv_channels", None, "hidden_size / num_attention_heads",
                                        one_of(None))
    window_size: int | None = _narrowed(ModelConfig, "window_size", None, "no sliding window", one_of(None))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_type == "bert" and self.type_vocab_size < 1:
            raise ValueError(f"a bert config needs type_vocab_size >= 1 (segments A/B), got {self.type_vocab_size}")


@dataclass
class LlamaConfig(ModelConfig):
    """A Llama-family decoder; ``layernorm_epsilon`` is RMSNorm's epsilon (Hugging Face's rms_norm_eps)."""

    model_type: str = option("llama", one_of("llama"), "llama")
    hidden_dropout: float = _narrowed(ModelConfig, "hidden_dropout", 0.0, "dropout on embeddings and residual "
                                      "branches (Llama: none)")
    attention_dropout: float = _narrowed(ModelConfig, "attention_dropout", 0.0, "dropout on attention probabilities "
                                         "(Llama: none)")
    tie_word_embeddings: bool = _narrowed(ModelConfig, "tie_word_embeddings", False, "output layer shares the word "
                                          "embedding weight (Llama: its own)")
    num_query_groups: int | None = option(None, optional(at_least(1)), "key/value heads g (grouped-query attention); "
                                          "None: one per head", "--num-query-groups")
    rotary_base: float = option(10000.0, positive_number, "rotary base theta (Hugging Face's rope_theta)",
                                "--rotary-base")
    rope_scaling: bool = option(False, boolean, "Llama 3.x's rotary scaling (Hugging Face's rope_type llama3): "
                                "the low frequencies slowed by rope_scaling_factor, the high ones kept, the middle "
                                "ones blended", "--use-rope-scaling")
    rope_scaling_factor: float = option(8.0, positive_number, "Llama 3.x's rotary scaling factor",
                                        "--rope-scaling-factor")
    rope_low_freq_factor: float = option(1.0, positive_number, "Llama 3.x's: wavelengths over original / this "
                                         "are slowed")
    rope_high_freq_factor: float = option(4.0, positive_number, "Llama 3.x's: wavelengths under original / this "
                                          "are kept")
    rope_original_max_positions: int = option(8192, at_least(1), "Llama 3.x's: the context length before scaling")
    position_embedding_type: str = _narrowed(ModelConfig, "position_embedding_type", "rope", "rotary positions",
                                             one_of("rope"))
    normalization: str = _narrowed(ModelConfig, "normalization", "RMSNorm", "RMSNorm", one_of("RMSNorm"))
    activation: str = _narrowed(ModelConfig, "activation", "swiglu", "SwiGLU MLP", one_of("swiglu"))
    add_bias_linear: bool = _narrowed(ModelConfig, "add_bias_linear", False, "no biases", one_of(False))
    add_qkv_bias: bool = _narrowed(ModelConfig, "add_qkv_bias", False, "no biases (Qwen2: on q, k, v)", one_of(False))
    qk_layernorm: bool = _narrowed(ModelConfig, "qk_layernorm", False, "no query/key norm (Qwen3: RMSNorm)",
                                   one_of(False))
    window_size: int | None = _narrowed(ModelConfig, "window_size", None, "no sliding window (Mistral: one)",
                                        one_of(None))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by num_query_groups="
                             f"{self.query_groups}: each kv head serves an equal share of the query heads")
        if self.rope_scaling and self.rope_low_freq_factor >= self.rope_high_freq_factor:
            raise ValueError(f"rope_low_freq_factor={self.rope_low_freq_factor} must be below rope_high_freq_factor="
                             f"{self.rope_high_freq_factor}: the middle frequencies lie between them")

    def rope_scaling_parameters(self) -> dict[str, float] | None:
        """``tpzoo.models.rope.Llama3Scaling``'s fields when ``rope_scaling``, else None."""
        if not self.rope_scaling:
            return None
        return dict(factor=self.rope_scaling_factor, low_freq_factor=self.rope_low_freq_factor,
                    high_freq_factor=self.rope_high_freq_factor, original_max_positions=self.rope_original_max_positions)


@dataclass
class Qwen2Config(LlamaConfig):
    """Qwen2 and Qwen2.5: a Llama with biases on the query, key and value projections."""

    model_type: str = option("qwen2", one_of("qwen2"), "qwen2")
    add_qkv_bias: bool = _narrowed(ModelConfig, "add_qkv_bias", True, "biases on q, k and v (only)", one_of(True))


@dataclass
class Qwen3Config(LlamaConfig):
    """Qwen3: a Llama with RMSNorm over each head's queries and keys, and its own head size (``kv_channels``)."""

    model_type: str = option("qwen3", one_of("qwen3"), "qwen3")
    qk_layernorm: bool = _narrowed(ModelConfig, "qk_layernorm", True, "RMSNorm on queries and keys", one_of(True))


@dataclass
class MistralConfig(LlamaConfig):
    """Mistral: a Llama with sliding-window attention (``window_size``; None in the later versions)."""

    model_type: str = option("mistral", one_of("mistral"), "mistral")
    window_size: int | None = _narrowed(ModelConfig, "window_size", None, "sliding-window attention (Mistral 7B "
                                        "v0.1: 4096); None: all earlier tokens")

    @property
    def ffn_size(self) -> int:
        """``ffn_hidden_size``, or Llama's 2/3 x 4h rounded up to a multiple of 256 when None."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return -(-(8 * self.hidden_size // 3) // 256) * 256


@dataclass
class MixtralConfig(MistralConfig):
    """Mixtral: a Mistral whose MLPs are mixtures of experts (``tpzoo.models.moe``; Megatron-LM's flags): each token
    goes through ``moe_router_topk`` of ``num_experts`` SwiGLU experts of ``moe_ffn_hidden_size`` features (None: the
    MLP width), by softmax scores renormalised over the chosen; the router's per-sequence load-balancing loss and
    z-loss join the training loss with their coefficients (0: off, as in Megatron-LM)."""

    model_type: str = option("mixtral", one_of("mixtral"), "mixtral")
    num_experts: int = option(8, at_least(1), "experts in each layer's MLP (a mixture of experts)", "--num-experts")
    moe_router_topk: int = option(2, at_least(1), "experts each token goes through", "--moe-router-topk")
    moe_ffn_hidden_size: int | None = option(None, optional(at_least(1)), "each expert's MLP width; None: "
                                             "ffn_hidden_size", "--moe-ffn-hidden-size")
    moe_aux_loss_coeff: float = option(0.0, non_negative_number, "weight of the router's load-balancing loss "
                                       "(N sum_e f_e P_e, per sequence) in the training loss", "--moe-aux-loss-coeff")
    moe_z_loss_coeff: float = option(0.0, non_negative_number, "weight of the router's z-loss (per sequence) in the "
                                     "training loss", "--moe-z-loss-coeff")
    moe_router_score_function: str = option("softmax", one_of("softmax", "sigmoid"), "the router's scores: softmax "
                                            "(Mixtral's, Qwen2-MoE's) or sigmoid (DeepSeek-V3's)",
                                            "--moe-router-score-function")
    moe_router_load_balancing_type: str = option(
        "seq_aux_loss", one_of("seq_aux_loss", "aux_loss", "none"), "the load-balancing loss over each sequence "
        "(the same for any micro-batch size), over each micro-batch (Megatron-LM's aux_loss) or none (with "
        "--moe-aux-loss-coeff 0)", "--moe-router-load-balancing-type")
    moe_expert_capacity_factor: float | None = option(
        None, optional(positive_number), "in training, each expert takes at most ceil(T k / N x this) of a "
        "micro-batch's T k routed slots, its heaviest, the others dropped (changes the math; None: dropless)",
        "--moe-expert-capacity-factor")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} is more than num_experts={self.num_experts}: "
                             f"a token goes through at most every expert; choose a top-k up to {self.num_experts}")
        if self.moe_router_load_balancing_type == "none" and self.moe_aux_loss_coeff:
            raise ValueError(f"--moe-router-load-balancing-type none adds no load-balancing loss for "
                             f"--moe-aux-loss-coeff {self.moe_aux_loss_coeff} to weigh; drop one of them")

    @property
    def expert_ffn_size(self) -> int:
        """Each expert's MLP width: ``moe_ffn_hidden_size``, or the MLP width (``ffn_size``) when None."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def size(self, name: str) -> int:
        return self.expert_ffn_size if name == "moe_ffn_hidden_size" else super().size(name)


@dataclass
class Qwen2MoeConfig(MixtralConfig):
    """Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (biases on q, k and v) and in every layer a mixture of experts
    whose chosen experts keep their softmax scores over all N (``norm_topk_prob`` False: Megatron-LM's pre-softmax
    routing; True: renormalised over the chosen, as Mixtral's), beside a shared expert, always on, its output gated by
    a sigmoid of the input."""

    model_type: str = option("qwen2_moe", one_of("qwen2_moe"), "qwen2_moe")
    add_qkv_bias: bool = _narrowed(ModelConfig, "add_qkv_bias", True, "biases on q, k and v (only)", one_of(True))
    window_size: int | None = _narrowed(ModelConfig, "window_size", None, "no sliding window", one_of(None))
    moe_shared_expert_intermediate_size: int | None = option(
        None, optional(at_least(1)), "the shared expert's MLP width (always on, gated by a sigmoid); None: none",
        "--moe-shared-expert-intermediate-size")
    norm_topk_prob: bool = option(False, boolean, "renormalise the chosen experts' scores to sum to 1")

    def size(self, name: str) -> int:
        """As ``MixtralConfig.size``; the shared expert's width 0 when there is none (nothing for tp to split)."""
        if name == "moe_shared_expert_intermediate_size":
            return self.moe_shared_expert_intermediate_size or 0
        return super().size(name)


def field_names(cls: type = TransformerConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]
