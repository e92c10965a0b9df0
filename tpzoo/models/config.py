"""Model configs: what a model is (sizes and kinds of blocks), one validated dataclass per family.

``ModelConfig`` holds what every tpzoo transformer has (layers, widths, heads, vocabulary, dropout,
init) and the traits Megatron-LM's architecture flags name (positions, norm, MLP activation,
biases), which the models read to build themselves; each family's config narrows the traits to
what the family is and adds its own fields: ``TransformerConfig`` (GPT-2 and BERT) and
``LlamaConfig``. How a model runs (mesh, sequence parallelism, recompute, kernels, seed) is not
config: it is the ``tpzoo.parallel.ParallelPlan`` applied to it.

Every field declares, next to it, its check, its meaning and the Megatron-LM flag that sets it
(``_field(default, check, doc, flag)``); ``__post_init__`` runs the checks, then those that tie
fields together. Errors name the field and the value. Sizes that depend on the mesh (heads or ffn
not divisible by tp) are checked when a model is built for a mesh (``ShardingPlan.tp_divides``). A
config round-trips through a plain dict (``to_dict`` / ``from_dict``), which is what a checkpoint
stores; ``from_dict`` also reads the older layouts (run options inside, traits absent). This module
imports without torch: the training scripts check their flags against it before torch loads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from tpzoo.flag_types import non_negative_float, non_negative_int, positive_float, positive_int, probability
from tpzoo.run_options import PLAN_OPTIONS

Check = Callable[[Any], str | None]  # returns what is wrong with the value, or None

LAYERNORM_POSITIONS = ("pre", "post")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")  # Megatron-LM's --position-embedding-type
NORMALIZATIONS = ("LayerNorm", "RMSNorm")                # Megatron-LM's --normalization
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "geglu")   # MLP activations; --swiglu: swiglu
# run options that checkpoints written before ParallelPlan kept in the model config (read and dropped)
OLD_RUN_OPTIONS = frozenset(PLAN_OPTIONS) - {"compile", "fsdp"}
# fields that change how a model computes or was initialised, not which weights it holds: a checkpoint
# loads into (and a run resumes with) a config that differs from the saved one only in these (checkpoints
# store the vocabulary unpadded, so its padding multiple is one of them)
RUN_OPTIONS = frozenset({"hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by"})


def _parses(parse: Callable[[str], Any]) -> Callable[[Check], Check]:
    """Give a check the ``tpzoo.flag_types`` function that reads its field's command-line flag (``parse``)."""
    def attach(check: Check) -> Check:
        check.parse = parse
        return check
    return attach


def _int(minimum: int) -> Check:
    @_parses(positive_int if minimum >= 1 else non_negative_int)
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"must be an int, got {type(v).__name__} {v!r}"
        return None if v >= minimum else f"must be >= {minimum}, got {v}"
    return check


def _optional(inner: Check) -> Check:
    """``inner``, or None; the same flag (its ``parse`` and ``choices``)."""
    check = lambda v: None if v is None else inner(v)  # noqa: E731
    check.__dict__.update(vars(inner))
    return check


@_parses(str)
def _text(v: Any) -> str | None:
    return None if isinstance(v, str) else f"must be a str, got {type(v).__name__} {v!r}"


@_parses(probability)
def _probability(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"must be a float in [0, 1), got {type(v).__name__} {v!r}"
    return None if 0.0 <= v < 1.0 else f"must lie in [0, 1), got {v}"


@_parses(positive_float)
def _positive_float(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return f"must be a finite float, got {type(v).__name__} {v!r}"
    return None if v > 0 else f"must be > 0, got {v}"


@_parses(non_negative_float)
def _non_negative_float(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return f"must be a finite float, got {type(v).__name__} {v!r}"
    return None if v >= 0 else f"must be >= 0, got {v}"


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"must be True or False, got {type(v).__name__} {v!r}"


def _choice(*options: Any) -> Check:
    """One of ``options``; its flag takes them as ``choices`` (read as their type: ints for ints)."""
    shown = ", ".join(repr(o) for o in options)
    check = _parses(type(options[0]))(lambda v: None if v in options else f"must be one of {shown}, got {v!r}")
    check.choices = options
    return check


def _field(default: Any, check: Check | None, doc: str, flag: str | tuple[str, ...] | None = None,
           metavar: str | tuple[str, ...] | None = None, **role: Any) -> Any:
    """A config field: its default, its check, its meaning and the Megatron-LM flag that sets it (if any; a tuple:
    the flag and its aliases; ``metavar``: what its value is called in --help). ``role``: how a run configuration
    treats the field (``tpzoo.training.run_config``: ``launch``, ``meaning``, ``path``, ``together``, ``nargs``)."""
    return field(default=default, metadata={"check": check, "doc": doc, "flag": flag, "metavar": metavar, **role})


def check_fields(config: Any) -> None:
    """ValueError naming the first field of the dataclass ``config`` whose check fails (a field without one passes)."""
    for f in dataclasses.fields(config):
        problem = (f.metadata.get("check") or (lambda v: None))(getattr(config, f.name))
        if problem:
            raise ValueError(f"{type(config).__name__}.{f.name} {problem}")


def _narrowed(cls: type, name: str, default: Any, doc: str, check: Check | None = None) -> Any:
    """Field ``name`` of ``cls`` with another default, meaning and (optionally) check; the same flag."""
    meta = cls.__dataclass_fields__[name].metadata
    return _field(default, check or meta["check"], doc, meta["flag"])


@dataclass
class ModelConfig:
    """What every tpzoo transformer has; a family's config subclasses it (see module docstring)."""

    model_type: str = _field("", lambda v: None if isinstance(v, str) and v else f"must name a family, got {v!r}",
                             "the model family (tpzoo.models.families)")
    num_layers: int = _field(12, _int(1), "transformer layers", "--num-layers")
    hidden_size: int = _field(768, _int(1), "width h of the residual stream", "--hidden-size")
    num_attention_heads: int = _field(12, _int(1), "attention heads n; h / n features each", "--num-attention-heads")
    ffn_hidden_size: int | None = _field(None, _optional(_int(1)), "MLP width f; None: the family's (GPT, BERT: 4 h)",
                                         "--ffn-hidden-size")
    vocab_size: int = _field(50257, _int(1), "real vocabulary V (padded inside: see make_vocab_size_divisible_by)")
    make_vocab_size_divisible_by: int = _field(128, _int(1), "the vocabulary is padded with unused rows to "
                                               "V' = a multiple of this x tp", "--make-vocab-size-divisible-by")
    max_position_embeddings: int = _field(1024, _int(1), "the longest sequence (learned positions: their count)",
                                          "--max-position-embeddings")
    hidden_dropout: float = _field(0.1, _probability, "dropout on embeddings and residual branches", "--hidden-dropout")
    attention_dropout: float = _field(0.1, _probability, "dropout on attention probabilities", "--attention-dropout")
    layernorm_epsilon: float = _field(1e-5, _positive_float, "epsilon of the norms (LayerNorm or RMSNorm)",
                                      "--norm-epsilon")
    tie_word_embeddings: bool = _field(True, _bool, "output layer shares the word embedding weight (Megatron-LM: "
                                       "False with --untie-embeddings-and-output-weights)",
                                       "--untie-embeddings-and-output-weights")
    init_method_std: float = _field(0.02, _positive_float, "std of the normal weight init", "--init-method-std")

    position_embedding_type: str = _field("learned_absolute", _choice(*POSITION_EMBEDDING_TYPES),
                                          "learned_absolute: a learned position table; rope: rotary positions",
                                          "--position-embedding-type")
    normalization: str = _field("LayerNorm", _choice(*NORMALIZATIONS), "the norms: LayerNorm or RMSNorm",
                                "--normalization")
    activation: str = _field("gelu", _choice(*ACTIVATIONS), "MLP activation: gelu (erf), gelu_tanh, or gated "
                             "swiglu / geglu (Megatron-LM's --swiglu: swiglu)", "--swiglu")
    add_bias_linear: bool = _field(True, _bool, "biases on the linear layers", "--add-bias-linear")

    def __post_init__(self) -> None:
        check_fields(self)  # a subclass's plain fields (no check) are taken as they are
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}: each head gets hidden_size / num_attention_heads "
                             f"features; choose a multiple of {self.num_attention_heads}")

    @property
    def ffn_size(self) -> int:
        """The MLP width: ``ffn_hidden_size``, or 4 x hidden_size when that is None."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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

    model_type: str = _field("gpt", _choice("gpt", "bert"), "gpt (causal, pre-LN) or bert (bidirectional, post-LN)")
    type_vocab_size: int = _field(0, _int(0), "token types (BERT segments); 0 for none")
    layernorm_position: str = _field("pre", _choice(*LAYERNORM_POSITIONS),
                                     "pre: x + f(LN(x)) and a final LN (GPT); post: LN(x + f(x)) (BERT)")
    num_labels: int = _field(2, _int(2), "classes of BertForSequenceClassification")
    position_embedding_type: str = _narrowed(ModelConfig, "position_embedding_type", "learned_absolute",
                                             "learned absolute positions", _choice("learned_absolute"))
    normalization: str = _narrowed(ModelConfig, "normalization", "LayerNorm", "LayerNorm", _choice("LayerNorm"))
    activation: str = _narrowed(ModelConfig, "activation", "gelu_tanh", "MLP activation: gelu (erf) or gelu_tanh",
                                _choice("gelu", "gelu_tanh"))
    add_bias_linear: bool = _narrowed(ModelConfig, "add_bias_linear", True, "biases on every linear layer",
                                      _choice(True))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_type == "bert" and self.type_vocab_size < 1:
            raise ValueError(f"a bert config needs type_vocab_size >= 1 (segments A/B), got {self.type_vocab_size}")


@dataclass
class LlamaConfig(ModelConfig):
    """A Llama-family decoder; ``layernorm_epsilon`` is RMSNorm's epsilon (Hugging Face's rms_norm_eps)."""

    model_type: str = _field("llama", _choice("llama"), "llama")
    hidden_dropout: float = _narrowed(ModelConfig, "hidden_dropout", 0.0, "dropout on embeddings and residual "
                                      "branches (Llama: none)")
    attention_dropout: float = _narrowed(ModelConfig, "attention_dropout", 0.0, "dropout on attention probabilities "
                                         "(Llama: none)")
    tie_word_embeddings: bool = _narrowed(ModelConfig, "tie_word_embeddings", False, "output layer shares the word "
                                          "embedding weight (Llama: its own)")
    num_query_groups: int | None = _field(None, _optional(_int(1)), "key/value heads g (grouped-query attention); "
                                          "None: one per head", "--num-query-groups")
    rotary_base: float = _field(10000.0, _positive_float, "rotary base theta (Hugging Face's rope_theta)",
                                "--rotary-base")
    position_embedding_type: str = _narrowed(ModelConfig, "position_embedding_type", "rope", "rotary positions",
                                             _choice("rope"))
    normalization: str = _narrowed(ModelConfig, "normalization", "RMSNorm", "RMSNorm", _choice("RMSNorm"))
    activation: str = _narrowed(ModelConfig, "activation", "swiglu", "SwiGLU MLP", _choice("swiglu"))
    add_bias_linear: bool = _narrowed(ModelConfig, "add_bias_linear", False, "no biases", _choice(False))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by num_query_groups="
                             f"{self.query_groups}: each kv head serves an equal share of the query heads")

    @property
    def ffn_size(self) -> int:
        """``ffn_hidden_size``, or Llama's 2/3 x 4h rounded up to a multiple of 256 when None."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return -(-(8 * self.hidden_size // 3) // 256) * 256


def field_names(cls: type = TransformerConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]
