"""The registry of model families: one entry per family, the only place the scripts, conversion,
generation, checkpoints and data learn what a family is (torchtitan's ``TrainSpec``).

    family("gpt").spec.models["GPTModel"]             # the model classes, config class, HF adapter ...
    family("gpt").data                                 # "causal-lm": what pretraining reads
    PRESETS["bert-base"]                               # every family's presets, by name
    family("llama").architecture                       # the model Megatron-LM's architecture flags describe

An entry (``Family``) is plain data, importable without torch, so the command lines can list the
families and presets before torch loads. The rest lives in the family's module (``Family.module``),
which defines ``SPEC`` (a ``FamilySpec``): its config class, model classes, parameter count and
Hugging Face adapter. Adding a family is one module plus one entry in ``FAMILIES`` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Callable

DATA_KINDS = ("causal-lm", "masked-lm")
FINETUNE_KINDS = ("causal-lm", "classification")


@dataclass(frozen=True)
class HFAdapter:
    """How a family converts to and from Hugging Face (``tpzoo.convert``), on full state dicts.

    ``model_type``: the Hugging Face config's; ``architectures``: Hugging Face class -> (tpzoo class,
    its constructor options); ``rules(config, arch)``: one ``tpzoo.models.hf_rules.Rule`` per tpzoo tensor.
    """

    model_type: str
    architectures: dict[str, tuple[str, dict[str, Any]]]
    config_from_hf: Callable[[Any, str], Any]
    config_to_hf: Callable[[Any, str], Any]
    rules: Callable[[Any, str], list]


@dataclass(frozen=True)
class FamilySpec:
    """What a family's module provides (its ``SPEC``).

    ``models``: class name -> class, every class a checkpoint may name; ``pretrain_model`` /
    ``finetune_model``: the class names pretrain.py and finetune.py build; ``num_parameters(config,
    head)``: the parameter count, as Hugging Face counts it (``head`` None: the pretraining model's).
    """

    config_class: type
    models: dict[str, type]
    pretrain_model: str
    finetune_model: str
    num_parameters: Callable[..., int]
    hf: HFAdapter | None = None
    model_options: Callable[[Any], dict[str, Any]] = field(default=lambda model: {})


@dataclass(frozen=True)
class Architecture:
    """A family's model in Megatron-LM's architecture flags (``tpzoo.training.architecture_args``):
    what every model of the family is (positions, norm, MLP, biases), and which of the flags that
    only change config fields it takes (``grouped_query``: --group-query-attention; every family
    takes --untie-embeddings-and-output-weights)."""

    position_embedding_type: str     # learned_absolute | rope (--position-embedding-type)
    normalization: str               # LayerNorm | RMSNorm (--normalization)
    swiglu: bool                     # a SwiGLU MLP (--swiglu), else GELU
    add_bias_linear: bool            # biases on every linear layer (--disable-bias-linear: False)
    grouped_query: bool = False      # its config has num_query_groups


_LEARNED_LN_GELU = Architecture("learned_absolute", "LayerNorm", swiglu=False, add_bias_linear=True)


@dataclass(frozen=True)
class Family:
    """One model family: its name (``--model``), module, data kind, presets and training defaults."""

    name: str
    module: str                                  # defines SPEC
    data: str                                    # one of DATA_KINDS: what pretraining reads
    finetune: str                                # one of FINETUNE_KINDS: what finetune.py trains
    presets: dict[str, dict[str, Any]]           # name -> config fields
    default_preset: str                          # the preset of pretrain.py --model NAME
    train_defaults: dict[str, Any]               # pretrain.py's schedule defaults for this family
    architecture: Architecture                   # as Megatron-LM's flags describe it

    def __post_init__(self) -> None:
        if self.data not in DATA_KINDS or self.finetune not in FINETUNE_KINDS:
            raise ValueError(f"family {self.name}: data must be one of {DATA_KINDS} and finetune one of "
                             f"{FINETUNE_KINDS}, got {self.data!r}, {self.finetune!r}")
        if self.default_preset not in self.presets:
            raise ValueError(f"family {self.name}: default preset {self.default_preset!r} is not among its presets")

    @property
    def spec(self) -> FamilySpec:
        """The family module's ``SPEC`` (imports the module, and torch)."""
        return import_module(self.module).SPEC


_GPT2 = dict(model_type="gpt", vocab_size=50257, max_position_embeddings=1024, layernorm_epsilon=1e-5,
             layernorm_position="pre", activation="gelu_tanh", type_vocab_size=0)
_BERT = dict(model_type="bert", vocab_size=30522, max_position_embeddings=512, layernorm_epsilon=1e-12,
             layernorm_position="post", activation="gelu", type_vocab_size=2)
_LLAMA = dict(model_type="llama", layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
              tie_word_embeddings=False)
# The tiny presets use the 512-token vocabulary of the bundled demo tokenizer.
_TINY = dict(vocab_size=512, max_position_embeddings=256)
# Post-LN BERT sits on the unigram plateau (MLM loss = unigram entropy) for hundreds of steps and does not
# leave it at GPT's lr 3e-3: it needs a lower lr and more steps (so does a Hugging Face BertForPreTraining).
_DECODER_DEFAULTS = dict(train_iters=300, lr=3e-3, min_lr=3e-4, lr_warmup_iters=30)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("gpt", "tpzoo.models.gpt", data="causal-lm", finetune="causal-lm", default_preset="gpt-tiny",
           train_defaults=_DECODER_DEFAULTS, architecture=_LEARNED_LN_GELU, presets={
               "gpt2": dict(_GPT2, num_layers=12, hidden_size=768, num_attention_heads=12),
               "gpt2-medium": dict(_GPT2, num_layers=24, hidden_size=1024, num_attention_heads=16),
               "gpt2-large": dict(_GPT2, num_layers=36, hidden_size=1280, num_attention_heads=20),
               "gpt2-xl": dict(_GPT2, num_layers=48, hidden_size=1600, num_attention_heads=25),
               "gpt-tiny": dict(_GPT2, **_TINY, num_layers=4, hidden_size=128, num_attention_heads=4,
                                hidden_dropout=0.1, attention_dropout=0.1)}),
    Family("bert", "tpzoo.models.bert", data="masked-lm", finetune="classification", default_preset="bert-tiny",
           train_defaults=dict(train_iters=1000, lr=1e-3, min_lr=1e-4, lr_warmup_iters=50),
           architecture=_LEARNED_LN_GELU, presets={
               "bert-base": dict(_BERT, num_layers=12, hidden_size=768, num_attention_heads=12),
               "bert-large": dict(_BERT, num_layers=24, hidden_size=1024, num_attention_heads=16),
               "bert-tiny": dict(_BERT, **_TINY, num_layers=2, hidden_size=128, num_attention_heads=4,
                                 hidden_dropout=0.1, attention_dropout=0.1)}),
    Family("llama", "tpzoo.models.llama", data="causal-lm", finetune="causal-lm", default_preset="llama-tiny",
           train_defaults=_DECODER_DEFAULTS,
           architecture=Architecture("rope", "RMSNorm", swiglu=True, add_bias_linear=False, grouped_query=True),
           presets={
               "llama-tiny": dict(_LLAMA, **_TINY, num_layers=4, hidden_size=128, num_attention_heads=4,
                                  num_query_groups=2, ffn_hidden_size=352),
               # TinyLlama-1.1B's shape
               "llama-1b": dict(_LLAMA, num_layers=22, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                                ffn_hidden_size=5632, vocab_size=32000, max_position_embeddings=2048),
               # Llama-3-8B's shape
               "llama-8b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                ffn_hidden_size=14336, vocab_size=128256, max_position_embeddings=8192,
                                rotary_base=500000.0)}),
)}
PRESETS: dict[str, dict[str, Any]] = {name: fields for f in FAMILIES.values() for name, fields in f.presets.items()}


def family(name: str) -> Family:
    """The registered family ``name`` (a config's ``model_type``, ``--model``)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def config_from_dict(data: dict[str, Any]) -> Any:
    """The config a checkpoint recorded, as its family's config class (older layouts included)."""
    return family(data.get("model_type", "gpt")).spec.config_class.from_dict(data)


def model_class(class_name: str) -> type:
    """The model class of any family named ``class_name`` (what checkpoints record)."""
    for f in FAMILIES.values():
        models = f.spec.models
        if class_name in models:
            return models[class_name]
    known = [name for f in FAMILIES.values() for name in f.spec.models]
    raise ValueError(f"unknown model class {class_name!r}; known: {', '.join(known)}")
