"""The model flags (``--model --preset``, the shape flags that override the preset, ``--seq-length``) and the model
config they make: ``ModelChoice`` is the run configuration's model section, ``model_config`` its config.

    add_model_args(parser)                               # --model, --preset, --num-layers ... (None until given)
    choice = ModelChoice.of(vars(args))                  # once resolve_architecture set the family
    config = model_config(choice, vocab_size=32000)      # the preset, overridden by the model flags given
    options = pretrain_options(choice)                   # the pretraining model's options (--bert-no-binary-head)

``--model`` names a family of ``tpzoo.models.families`` and ``--preset`` any family's preset; the shape flags are
the config fields that declare a flag of their own name (``ModelConfig.flag_fields``), generated from them.
Imports without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from tpzoo.fields import add_section, at_least, option, optional, string, toggle
from tpzoo.models.config import ModelConfig, field_names
from tpzoo.models.families import FAMILIES, PRESETS, family
from tpzoo.models.family_flag import family_name
from tpzoo.models.presets import get_preset


@dataclass(frozen=True)
class ModelChoice:
    """What model a run trains: the family, the preset (None: the family's default), the sequence length, the
    config fields the shape flags give (``given``) and those Megatron-LM's architecture flags set
    (``architecture``, ``tpzoo.training.architecture_args.resolve_architecture``); ``no_binary_head``: without the
    family's binary head (``--bert-no-binary-head``, ``Family.no_binary_head``; ``pretrain_options``)."""

    model: str | None
    preset: str | None = None
    seq_length: int = 64
    given: Mapping[str, Any] = field(default_factory=dict)
    architecture: Mapping[str, Any] = field(default_factory=dict)
    no_binary_head: bool = False

    @classmethod
    def of(cls, flags: Mapping[str, Any]) -> ModelChoice:
        """The model section of ``flags`` (a command's flags by destination)."""
        given = {name: flags[name] for name in model_flag_fields() if flags.get(name) is not None}
        return cls(flags.get("model"), flags.get("preset"), flags.get("seq_length", 64), MappingProxyType(given),
                   MappingProxyType(dict(flags.get("architecture_changes") or {})),
                   bool(flags.get("bert_no_binary_head")))


def check_preset(preset: str | None) -> None:
    """ValueError unless ``--preset`` (if given) is a preset of a registered family."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"--preset {preset}: unknown preset; choose one of {', '.join(PRESETS)}")


def model_flag_fields() -> dict[str, dataclasses.Field]:
    """The config fields, of every registered family's config, that a flag of their own name sets (``--num-layers``:
    ``num_layers``; ``ModelConfig.flag_fields``): the flags that override a preset's value."""
    out = dict(ModelConfig.flag_fields())
    for f in FAMILIES.values():
        out.update({k: v for k, v in f.config_class.flag_fields().items() if k not in out})
    return out


def config_field(name: str, help: str = "default: the preset's") -> Any:
    """A field for the model config field ``name``'s flag (``tpzoo.models.config``: its name, check and meaning),
    None until given."""
    meta = model_flag_fields()[name].metadata
    return option(None, optional(meta["check"]), f"{meta['doc']} ({help})", meta["flag"])


@dataclass(frozen=True)
class ModelFlags:
    """The model group: the family (None until given: ``resolve_architecture`` sets the one Megatron-LM's
    architecture flags describe), the preset and the shape fields that override it (None: the preset's), the sequence
    length, a pretraining model without its binary head."""

    model: str | None = option(None, optional(family_name), "the model family", "--model", "FAMILY")
    preset: str | None = option(None, optional(string), "model shape, a preset of the --model family", "--preset",
                                "NAME")
    num_layers: int | None = config_field("num_layers")
    hidden_size: int | None = config_field("hidden_size")
    num_attention_heads: int | None = config_field("num_attention_heads")
    num_query_groups: int | None = config_field("num_query_groups")
    num_experts: int | None = config_field("num_experts")
    moe_router_topk: int | None = config_field("moe_router_topk")
    moe_ffn_hidden_size: int | None = config_field("moe_ffn_hidden_size")
    moe_aux_loss_coeff: float | None = config_field("moe_aux_loss_coeff")
    moe_z_loss_coeff: float | None = config_field("moe_z_loss_coeff")
    moe_shared_expert_intermediate_size: int | None = config_field("moe_shared_expert_intermediate_size")
    moe_router_score_function: str | None = config_field("moe_router_score_function")
    moe_router_load_balancing_type: str | None = config_field("moe_router_load_balancing_type")
    moe_expert_capacity_factor: float | None = config_field("moe_expert_capacity_factor")
    ffn_hidden_size: int | None = config_field("ffn_hidden_size")
    max_position_embeddings: int | None = config_field("max_position_embeddings")
    hidden_dropout: float | None = config_field("hidden_dropout")
    attention_dropout: float | None = config_field("attention_dropout")
    seq_length: int = option(64, at_least(1), "tokens per training sequence", "--seq-length", meaning=True)
    bert_no_binary_head: bool = toggle("pretrain without the binary (sentence-order) head, on samples without that "
                                       "task: the masked-LM loss alone (bert)", "--bert-no-binary-head", meaning=True)


def add_model_args(parser: argparse.ArgumentParser, default_model: str = "gpt") -> None:
    """The model group (``ModelFlags``), its help naming the registered families and presets and ``default_model``,
    the family when the architecture flags describe several."""
    add_section(parser, ModelFlags, "model")
    parser.set_defaults(default_model=default_model)
    flags = parser._option_string_actions
    flags["--model"].help = (f"the model family: {', '.join(FAMILIES)}, or module:NAME, a tpzoo.models.Family of your "
                             f"own (docs/new-model.md) (default: the one Megatron-LM's architecture flags describe, "
                             f"{default_model} without them)")
    defaults = ", ".join(f.default_preset for f in FAMILIES.values())
    flags["--preset"].help = (f"model shape, a preset of the --model family: {', '.join(PRESETS)} (default: the "
                              f"family's {defaults})")


def model_config(choice: ModelChoice, base: ModelConfig | None = None, **changes: Any) -> ModelConfig:
    """``base`` (default: ``--preset``, else the ``--model`` family's default preset) with the model
    flags given, the architecture flags' fields and ``changes`` applied. A flag the family's config has no field for
    is a ValueError."""
    fam = family(choice.model)
    if base is None:
        base = get_preset(choice.preset or fam.default_preset)
    if base.model_type != fam.name:
        raise ValueError(f"--preset {choice.preset} is a {base.model_type} model but --model is {choice.model}; "
                         f"drop one of them or make them agree")
    given = dict(choice.given)
    foreign = [name for name in given if name not in field_names(type(base))]
    if foreign:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in foreign)
        raise ValueError(f"{flags} does not apply to --model {base.model_type} (its {type(base).__name__} has no "
                         f"{', '.join(foreign)}); drop it")
    config = base.replace(**given, **{**choice.architecture, **changes})
    if choice.seq_length > config.max_position_embeddings:
        raise ValueError(f"--seq-length {choice.seq_length} exceeds --max-position-embeddings "
                         f"{config.max_position_embeddings}; lower the first or raise the second")
    return config


def check_experts(choice: ModelChoice, ep: int = 1, grouped_gemm: bool = False) -> None:
    """ValueError unless the expert options fit the model ``choice`` builds: ``ep`` (--expert-model-parallel-size) > 1
    and ``grouped_gemm`` (--moe-grouped-gemm) need a family with a mixture of experts, and ep must divide its
    ``num_experts`` (the preset's or --num-experts)."""
    given = [(flag, verb) for flag, verb, on in ((f"--expert-model-parallel-size {ep}", "split", ep > 1),
                                                 ("--moe-grouped-gemm", "group", grouped_gemm)) if on]
    if not given:
        return
    experts = getattr(model_config(choice), "num_experts", None)
    if experts is None:
        flag, verb = given[0]
        raise ValueError(f"{flag}: --model {choice.model} has no experts to {verb}; drop it, or train a mixture of "
                         f"experts (--model mixtral or qwen2_moe)")
    if experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {experts} experts (--num-experts); "
                         f"choose an ep dividing {experts}")


def pretrain_options(choice: ModelChoice, saved: tuple[str, Mapping[str, Any]] | None = None,
                     load: str | None = None) -> dict[str, Any]:
    """The constructor options of the pretraining model a run of ``choice`` builds, as far as its binary head goes:
    the one place that decides whether it has one (pretrain.py's ``check_flags`` before torch loads, then
    ``tpzoo.training.setup.build_run``, whose samples follow it: ``Family.without_binary_head``).
    ``--bert-no-binary-head``: the family's ``Family.no_binary_head``. ``saved``: the class name and constructor
    options that ``load``, a model folder (--load FOLDER --finetune) or a checkpoint of the pretraining model, records:
    its model is built as it was saved, with its options, which the flag must agree with. ValueError naming the flag
    and the fix where it cannot be honoured."""
    fam = family(choice.model)
    if choice.no_binary_head and fam.no_binary_head is None:
        raise ValueError(f"--bert-no-binary-head: --model {choice.model} has no binary (sentence-order) head to "
                         f"leave out; drop it")
    if saved is None:
        return dict(fam.no_binary_head) if choice.no_binary_head else {}
    class_name, options = saved
    if choice.no_binary_head and not fam.without_binary_head(options):
        raise ValueError(f"--bert-no-binary-head: {load}'s {class_name} has a binary head (it records options "
                         f"{dict(options)}), which loading it cannot drop; drop the flag, or pretrain from scratch "
                         f"without --load")
    return dict(options)
