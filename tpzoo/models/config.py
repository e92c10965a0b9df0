"""``TransformerConfig``: the shape and options of a GPT or BERT, one validated dataclass.

Every field declares its own check next to it (``_field(default, check, doc)``); ``__post_init__``
runs them all, then the checks that tie fields together (hidden_size / num_attention_heads).
Errors name the field and the value. Sizes that depend on the mesh (heads or ffn not divisible by
tp) are checked when a model is built for a mesh (``check_tensor_parallel``).

The config round-trips through a plain dict (``to_dict`` / ``from_dict``), which is what a
checkpoint stores. Megatron-LM's names are used where it has one (``--num-layers`` ->
``num_layers``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

Check = Callable[[Any], str | None]  # returns what is wrong with the value, or None

MODEL_TYPES = ("gpt", "bert")
LAYERNORM_POSITIONS = ("pre", "post")
ACTIVATIONS = ("gelu", "gelu_tanh")
ATTENTION_BACKENDS = ("auto", "fused-softmax", "sdpa")
KERNEL_BACKENDS = ("auto", "triton", "torch")
# fields that change how a model computes or was initialised, not which weights it holds: a checkpoint
# loads into (and a run resumes with) a config that differs from the saved one only in these
RUN_OPTIONS = frozenset({"hidden_dropout", "attention_dropout", "attention_backend", "kernels",
                         "recompute_activations", "sequence_parallel", "init_method_std", "seed"})


def _int(minimum: int) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"must be an int, got {type(v).__name__} {v!r}"
        return None if v >= minimum else f"must be >= {minimum}, got {v}"
    return check


def _optional(inner: Check) -> Check:
    return lambda v: None if v is None else inner(v)


def _probability(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"must be a float in [0, 1), got {type(v).__name__} {v!r}"
    return None if 0.0 <= v < 1.0 else f"must lie in [0, 1), got {v}"


def _positive_float(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return f"must be a finite float, got {type(v).__name__} {v!r}"
    return None if v > 0 else f"must be > 0, got {v}"


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"must be True or False, got {type(v).__name__} {v!r}"


def _choice(*options: str | None) -> Check:
    shown = ", ".join(repr(o) for o in options)
    return lambda v: None if v in options else f"must be one of {shown}, got {v!r}"


def _field(default: Any, check: Check, doc: str) -> Any:
    return field(default=default, metadata={"check": check, "doc": doc})


@dataclass
class TransformerConfig:
    """The architecture and run options of a tpzoo GPT or BERT (see docs/models.md)."""

    model_type: str = _field("gpt", _choice(*MODEL_TYPES), "gpt (causal, pre-LN) or bert (bidirectional, post-LN)")
    num_layers: int = _field(12, _int(1), "transformer layers")
    hidden_size: int = _field(768, _int(1), "width h of the residual stream")
    num_attention_heads: int = _field(12, _int(1), "attention heads n; h / n features each")
    ffn_hidden_size: int | None = _field(None, _optional(_int(1)), "MLP width f; None means 4 x hidden_size")
    vocab_size: int = _field(50257, _int(1), "real vocabulary V (padded to a multiple of 128 x tp inside)")
    max_position_embeddings: int = _field(1024, _int(1), "learned positions: the longest sequence")
    type_vocab_size: int = _field(0, _int(0), "token types (BERT segments); 0 for none")
    hidden_dropout: float = _field(0.1, _probability, "dropout on embeddings and residual branches")
    attention_dropout: float = _field(0.1, _probability, "dropout on attention probabilities")
    layernorm_epsilon: float = _field(1e-5, _positive_float, "LayerNorm epsilon")
    layernorm_position: str = _field("pre", _choice(*LAYERNORM_POSITIONS),
                                     "pre: x + f(LN(x)) and a final LN (GPT); post: LN(x + f(x)) (BERT)")
    activation: str = _field("gelu_tanh", _choice(*ACTIVATIONS), "MLP activation: gelu (erf) or gelu_tanh")
    tie_word_embeddings: bool = _field(True, _bool, "output layer shares the word embedding weight")
    init_method_std: float = _field(0.02, _positive_float, "std of the normal weight init")
    num_labels: int = _field(2, _int(2), "classes of BertForSequenceClassification")
    attention_backend: str = _field("auto", _choice(*ATTENTION_BACKENDS),
                                    "core attention: fused-softmax kernels, torch sdpa, or auto")
    kernels: str | None = _field(None, _choice(None, *KERNEL_BACKENDS),
                                 "tpzoo.kernels backend; None reads TPZOO_KERNELS")
    recompute_activations: bool = _field(False, _bool, "recompute each layer's activations in backward")
    sequence_parallel: bool = _field(False, _bool, "split LayerNorm/dropout activations along the sequence")
    seed: int = _field(1234, _int(0), "weights seed: piece i is built under a seed derived from (seed, i)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = f.metadata["check"](getattr(self, f.name))
            if problem:
                raise ValueError(f"TransformerConfig.{f.name} {problem}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}: each head gets hidden_size / num_attention_heads "
                             f"features; choose a multiple of {self.num_attention_heads}")
        if self.model_type == "bert" and self.type_vocab_size < 1:
            raise ValueError(f"a bert config needs type_vocab_size >= 1 (segments A/B), got {self.type_vocab_size}")

    @property
    def ffn_size(self) -> int:
        """The MLP width: ``ffn_hidden_size``, or 4 x hidden_size when that is None."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def causal(self) -> bool:
        """GPT attends to earlier positions only; BERT to every non-padding position."""
        return self.model_type == "gpt"

    @property
    def output_init_std(self) -> float:
        """Init std of the projections into the residual stream: GPT-2 scales it by 1/sqrt(2 num_layers)."""
        if self.model_type == "gpt":
            return self.init_method_std / math.sqrt(2.0 * self.num_layers)
        return self.init_method_std

    def replace(self, **changes: Any) -> TransformerConfig:
        """A copy with ``changes`` applied and validated (e.g. command-line overrides of a preset)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown TransformerConfig field(s) {unknown}; known: {field_names()}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Inverse of ``to_dict``; missing fields take their defaults, unknown ones raise."""
        unknown = sorted(set(data) - set(field_names()))
        if unknown:
            raise ValueError(f"unknown TransformerConfig field(s) {unknown}; known: {field_names()}")
        return cls(**data)


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TransformerConfig)]


def check_tensor_parallel(config: TransformerConfig, tp: int) -> None:
    """Raise if the tensor-parallel size ``tp`` cannot split this model's heads and MLP."""
    if config.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} is not divisible by the tensor-parallel "
                         f"size tp={tp}: tp ranks split the heads; choose tp dividing {config.num_attention_heads}")
    if config.ffn_size % tp:
        raise ValueError(f"ffn_hidden_size={config.ffn_size} is not divisible by the tensor-parallel size tp={tp}; "
                         f"choose ffn_hidden_size a multiple of {tp} or another tp")
