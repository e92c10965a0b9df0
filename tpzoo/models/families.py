"""The registry of model families: what scripts, conversion, generation, checkpoints and data learn of a
family, in one entry each (torchtitan's ``TrainSpec``), open to families that live outside tpzoo.

    family("gpt").spec.models["GPTModel"]             # the model classes, the Hugging Face adapter ...
    family("llama").config_class                      # LlamaConfig: the family's traits and flags
    family("gpt").data                                 # "causal-lm": what pretraining reads
    resolve_family("my_pkg.my_module:NEOX")            # imported, registered, returned
    register_family(NEOX, source="my_pkg.my_module:NEOX")

An entry (``Family``) is plain data; the built-in ones import without torch (their configs live in
``tpzoo.models.config``), so the command lines check their flags before torch loads. The rest lives in
the family's module (``Family.module``), which defines ``SPEC`` (a ``FamilySpec``): model classes,
parameter count and Hugging Face adapter. A family from outside the tree is a module of one's own
with a ``Family`` and a ``SPEC`` in it, named on the command line as ``--model module:NAME``
(``resolve_family``) or registered from Python (``register_family``). Only a name the user gives is
imported: a checkpoint records the ``source`` of its family and loading one whose family is not
registered is refused with that name in the message (``config_from_dict``), never imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Callable

from tpzoo.models.config import (LlamaConfig, MistralConfig, MixtralConfig, ModelConfig, Qwen2Config, Qwen2MoeConfig,
                                 Qwen3Config, TransformerConfig)

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
    ``finetune_model``: the class names pretrain.py and finetune.py build (finetune.py: on text without
    labels); ``classifier_model``: the sequence classifier finetune.py builds for labelled data (None: the
    family has none); ``num_parameters(config, head)``: the parameter count, as Hugging Face counts it
    (``head`` None: the pretraining model's; "classification": the classifier's).
    """

    models: dict[str, type]
    pretrain_model: str
    finetune_model: str
    num_parameters: Callable[..., int]
    classifier_model: str | None = None
    hf: HFAdapter | None = None
    model_options: Callable[[Any], dict[str, Any]] = field(default=lambda model: {})


@dataclass(frozen=True)
class Family:
    """One model family: its name (a config's ``model_type``), module (defines ``SPEC``), config class (its
    fields, traits and Megatron-LM flags), data kind, presets and training defaults; ``no_binary_head``: the
    constructor options (a non-empty dict) of its pretraining model without its binary (sentence-order or
    next-sentence) head, which then trains on samples without that task (pretrain.py's ``--bert-no-binary-head``,
    checked before torch loads; None: the family has no such head)."""

    name: str
    module: str
    config_class: type[ModelConfig]
    data: str                                    # one of DATA_KINDS: what pretraining reads
    finetune: str                                # one of FINETUNE_KINDS: what finetune.py trains
    presets: dict[str, dict[str, Any]]           # name -> config fields
    default_preset: str                          # the preset of pretrain.py --model NAME
    train_defaults: dict[str, Any]               # pretrain.py's schedule defaults for this family
    no_binary_head: dict[str, Any] | None = None  # the pretraining model's options without its binary head

    def __post_init__(self) -> None:
        if self.data not in DATA_KINDS or self.finetune not in FINETUNE_KINDS:
            raise ValueError(f"family {self.name}: data must be one of {DATA_KINDS} and finetune one of "
                             f"{FINETUNE_KINDS}, got {self.data!r}, {self.finetune!r}")
        if self.default_preset not in self.presets:
            raise ValueError(f"family {self.name}: default preset {self.default_preset!r} is not among its presets")
        if self.no_binary_head is not None and not self.no_binary_head:
            raise ValueError(f"family {self.name}: no_binary_head must name the options that leave the head out, "
                             f"or be None")

    def without_binary_head(self, options: dict[str, Any]) -> bool:
        """Whether the pretraining model built with constructor ``options`` (the flags', or a model folder's) lacks
        its binary head, and so reads samples without the sentence task (``no_binary_head``)."""
        return self.no_binary_head is not None and all(k in options and options[k] == v
                                                       for k, v in self.no_binary_head.items())

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
_QWEN2 = dict(_LLAMA, model_type="qwen2", tie_word_embeddings=True)
_QWEN3 = dict(_QWEN2, model_type="qwen3")
_QWEN_REAL = dict(layernorm_epsilon=1e-6, vocab_size=151936, rotary_base=1000000.0)  # Qwen2.5's and Qwen3's
_MISTRAL = dict(_LLAMA, model_type="mistral")
_MIXTRAL = dict(_LLAMA, model_type="mixtral")
_QWEN2_MOE = dict(_LLAMA, model_type="qwen2_moe")
# The tiny presets use the 512-token vocabulary of the bundled demo tokenizer.
_TINY = dict(vocab_size=512, max_position_embeddings=256)
# Post-LN BERT sits on the unigram plateau (MLM loss = unigram entropy) for hundreds of steps and does not
# leave it at GPT's lr 3e-3: it needs a lower lr and more steps (so does a Hugging Face BertForPreTraining).
DECODER_DEFAULTS = dict(train_iters=300, lr=3e-3, min_lr=3e-4, lr_warmup_iters=30)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("gpt", "tpzoo.models.gpt", TransformerConfig, data="causal-lm", finetune="causal-lm",
           default_preset="gpt-tiny", train_defaults=DECODER_DEFAULTS, presets={
               "gpt2": dict(_GPT2, num_layers=12, hidden_size=768, num_attention_heads=12),
               "gpt2-medium": dict(_GPT2, num_layers=24, hidden_size=1024, num_attention_heads=16),
               "gpt2-large": dict(_GPT2, num_layers=36, hidden_size=1280, num_attention_heads=20),
               "gpt2-xl": dict(_GPT2, num_layers=48, hidden_size=1600, num_attention_heads=25),
               "gpt-tiny": dict(_GPT2, **_TINY, num_layers=4, hidden_size=128, num_attention_heads=4,
                                hidden_dropout=0.1, attention_dropout=0.1)}),
    Family("bert", "tpzoo.models.bert", TransformerConfig, data="masked-lm", finetune="classification",
           default_preset="bert-tiny", train_defaults=dict(train_iters=1000, lr=1e-3, min_lr=1e-4, lr_warmup_iters=50),
           no_binary_head={"add_binary_head": False},
           presets={
               "bert-base": dict(_BERT, num_layers=12, hidden_size=768, num_attention_heads=12),
               "bert-large": dict(_BERT, num_layers=24, hidden_size=1024, num_attention_heads=16),
               "bert-tiny": dict(_BERT, **_TINY, num_layers=2, hidden_size=128, num_attention_heads=4,
                                 hidden_dropout=0.1, attention_dropout=0.1)}),
    Family("llama", "tpzoo.models.llama", LlamaConfig, data="causal-lm", finetune="causal-lm",
           default_preset="llama-tiny", train_defaults=DECODER_DEFAULTS, presets={
               "llama-tiny": dict(_LLAMA, **_TINY, num_layers=4, hidden_size=128, num_attention_heads=4,
                                  num_query_groups=2, ffn_hidden_size=352),
               # TinyLlama-1.1B's shape
               "llama-1b": dict(_LLAMA, num_layers=22, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                                ffn_hidden_size=5632, vocab_size=32000, max_position_embeddings=2048),
               # Llama-3-8B's shape
               "llama-8b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                ffn_hidden_size=14336, vocab_size=128256, max_position_embeddings=8192,
                                rotary_base=500000.0),
               # Llama-3.2-1B's shape: Llama 3.x's scaled rotary positions, a tied output layer
               "llama3.2-1b": dict(_LLAMA, num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                                   ffn_hidden_size=8192, vocab_size=128256, max_position_embeddings=131072,
                                   rotary_base=500000.0, tie_word_embeddings=True, rope_scaling=True,
                                   rope_scaling_factor=32.0)}),
    Family("qwen2", "tpzoo.models.qwen2", Qwen2Config, data="causal-lm", finetune="causal-lm",
           default_preset="qwen2-tiny", train_defaults=DECODER_DEFAULTS, presets={
               "qwen2-tiny": dict(_QWEN2, **_TINY, num_layers=4, hidden_size=128, num_attention_heads=4,
                                  num_query_groups=2, ffn_hidden_size=352),
               # Qwen2.5-0.5B's shape
               "qwen2.5-0.5b": dict(_QWEN2, **_QWEN_REAL, num_layers=24, hidden_size=896, num_attention_heads=14,
                                    num_query_groups=2, ffn_hidden_size=4864, max_position_embeddings=32768)}),
    Family("qwen3", "tpzoo.models.qwen3", Qwen3Config, data="causal-lm", finetune="causal-lm",
           default_preset="qwen3-tiny", train_defaults=DECODER_DEFAULTS, presets={
               # heads of 48 features over a width of 128: the head size is its own, as in Qwen3
               "qwen3-tiny": dict(_QWEN3, **_TINY, num_layers=4, hidden_size=128, num_attention_heads=4,
                                  num_query_groups=2, kv_channels=48, ffn_hidden_size=352),
               # Qwen3-0.6B's shape
               "qwen3-0.6b": dict(_QWEN3, **_QWEN_REAL, num_layers=28, hidden_size=1024, num_attention_heads=16,
                                  num_query_groups=8, kv_channels=128, ffn_hidden_size=3072,
                                  max_position_embeddings=40960)}),
    Family("mistral", "tpzoo.models.mistral", MistralConfig, data="causal-lm", finetune="causal-lm",
           default_preset="mistral-tiny", train_defaults=DECODER_DEFAULTS, presets={
               "mistral-tiny": dict(_MISTRAL, **_TINY, num_layers=4, hidden_size=128, num_attention_heads=4,
                                    num_query_groups=2, ffn_hidden_size=352, window_size=16),
               # Mistral-7B-v0.1's shape: a window of 4096 tokens
               "mistral-7b": dict(_MISTRAL, num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                  ffn_hidden_size=14336, vocab_size=32000, max_position_embeddings=32768,
                                  window_size=4096)}),
    Family("mixtral", "tpzoo.models.mixtral", MixtralConfig, data="causal-lm", finetune="causal-lm",
           default_preset="mixtral-tiny", train_defaults=DECODER_DEFAULTS, presets={
               "mixtral-tiny": dict(_MIXTRAL, **_TINY, num_layers=4, hidden_size=128, num_attention_heads=4,
                                    num_query_groups=2, ffn_hidden_size=128, num_experts=4, moe_router_topk=2),
               # Mixtral-8x7B's shape: 8 experts of 14336, top 2
               "mixtral-8x7b": dict(_MIXTRAL, num_layers=32, hidden_size=4096, num_attention_heads=32,
                                    num_query_groups=8, ffn_hidden_size=14336, vocab_size=32000,
                                    max_position_embeddings=32768, rotary_base=1000000.0, num_experts=8,
                                    moe_router_topk=2),
               # a 1B-class Mixtral (Llama-3.2-1B's attention, 8 experts of 1536, top 2): bench/models.py's shape
               "mixtral-1b": dict(_MIXTRAL, num_layers=16, hidden_size=2048, num_attention_heads=32,
                                  num_query_groups=8, ffn_hidden_size=1536, vocab_size=32000,
                                  max_position_embeddings=4096, num_experts=8, moe_router_topk=2)}),
    Family("qwen2_moe", "tpzoo.models.qwen2_moe", Qwen2MoeConfig, data="causal-lm", finetune="causal-lm",
           default_preset="qwen2-moe-tiny", train_defaults=DECODER_DEFAULTS, presets={
               "qwen2-moe-tiny": dict(_QWEN2_MOE, **_TINY, num_layers=4, hidden_size=128, num_attention_heads=4,
                                      num_query_groups=2, ffn_hidden_size=128, num_experts=4, moe_router_topk=2,
                                      moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=128),
               # Qwen1.5-MoE-A2.7B's shape: 60 experts of 1408, top 4, a shared expert of 5632
               "qwen1.5-moe-a2.7b": dict(_QWEN2_MOE, **_QWEN_REAL, num_layers=24, hidden_size=2048,
                                         num_attention_heads=16, num_query_groups=16, ffn_hidden_size=5632,
                                         max_position_embeddings=8192, num_experts=60, moe_router_topk=4,
                                         moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=5632)}),
)}
PRESETS: dict[str, dict[str, Any]] = {name: fields for f in FAMILIES.values() for name, fields in f.presets.items()}
SOURCES: dict[str, str] = {}  # family name -> "module:NAME" it came from, for the families from outside tpzoo


def register_family(fam: Family, source: str | None = None) -> Family:
    """Make ``fam`` known to every lookup (``--model``, checkpoints, conversion, generation), with the
    ``module:NAME`` it came from (recorded in checkpoints). Registering the same family again only adds a
    source it lacked; a name or preset another family has is a ValueError."""
    if not isinstance(fam, Family):
        raise TypeError(f"register_family takes a tpzoo.models.Family, got {type(fam).__name__}")
    if FAMILIES.get(fam.name) != fam:
        if fam.name in FAMILIES:
            raise ValueError(f"a model family named {fam.name!r} is registered already "
                             f"({FAMILIES[fam.name].module}); give yours another name")
        taken = sorted(set(fam.presets) & set(PRESETS))
        if taken:
            raise ValueError(f"family {fam.name}: presets {taken} belong to another family; rename them")
        FAMILIES[fam.name] = fam
        PRESETS.update(fam.presets)
    if source:
        SOURCES.setdefault(fam.name, source)
    return fam


def _registered(model: str) -> Family | None:
    """The registered family named ``model``, or registered from the ``module:NAME`` ``model``."""
    if model in FAMILIES:
        return FAMILIES[model]
    return next((FAMILIES[name] for name, source in SOURCES.items() if source == model), None)


def resolve_family(model: str) -> Family:
    """The family ``model`` names: a registered name, or ``module:NAME`` (the module imported, its ``NAME`` a
    ``Family``, registered). ValueError naming what is wrong and the fix."""
    if ":" not in model or _registered(model) is not None:
        return family(model)
    module_name, _, attribute = model.partition(":")
    try:
        module = import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise ValueError(f"{model}: importing {module_name} needs module {e.name!r}, which is not "
                             f"installed") from None
        raise ValueError(f"{model}: no module {e.name!r} to import; put the folder holding {module_name} on "
                         f"PYTHONPATH or install it") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed as it ran: one line, not a traceback
        raise ValueError(f"{model}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    fam = getattr(module, attribute, None)
    if not isinstance(fam, Family):
        raise ValueError(f"{model}: {module_name} has no tpzoo.models.Family named {attribute!r} "
                         f"(found {type(fam).__name__}); name the Family object after the colon")
    return register_family(fam, model)


def family(name: str) -> Family:
    """The registered family ``name`` (a config's ``model_type``, ``--model``; or the ``module:NAME`` it was
    registered from)."""
    found = _registered(name)
    if found is None:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}, or a module:NAME of your own")
    return found


def config_from_dict(data: dict[str, Any], source: str | None = None, model: type | None = None) -> ModelConfig:
    """The config a checkpoint recorded, as its family's config class (older layouts included). ``source``:
    the ``module:NAME`` the checkpoint's family came from; a family not registered here is refused naming
    it (never imported: only the user's --model imports). ``model``: a model class the caller holds; its
    ``config_class`` reads a config of its ``model_type``, registered or not."""
    name = data.get("model_type", "gpt")
    if model is not None and getattr(model, "model_type", None) == name:
        return model.config_class.from_dict(data)
    if name not in FAMILIES:
        where = f" (defined in {source})" if source else ""
        fix = f"pass --model {source}" if source else "register its family (tpzoo.models.register_family)"
        raise ValueError(f"the model is of family {name!r}{where}, which is not registered in this process; {fix} "
                         f"to load it (tpzoo never imports a module that a checkpoint names)")
    return FAMILIES[name].config_class.from_dict(data)


def model_class(class_name: str, family_name: str | None = None) -> type:
    """The model class named ``class_name`` (what checkpoints record): of family ``family_name`` (a config's
    model_type) when given and it has one by that name, else of any registered family."""
    own = _registered(family_name) if family_name is not None else None
    searched = ([own] if own is not None else []) + [f for f in FAMILIES.values() if f is not own]
    for f in searched:
        if class_name in f.spec.models:
            return f.spec.models[class_name]
    known = [name for f in searched for name in f.spec.models]
    raise ValueError(f"unknown model class {class_name!r}; known: {', '.join(known)}")
