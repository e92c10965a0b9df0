"""Hugging Face <-> tpzoo, on full (unsharded) state dicts and configs: pure functions, no process group.

What converts comes from the registry of model families (``tpzoo.models.families``): each family's
``HFAdapter`` names its Hugging Face model type and architectures, converts its configs and lists
one ``tpzoo.models.hf_rules.Rule`` per tpzoo tensor. This module finds the adapter of an
architecture (or of a tpzoo model class) and applies it; no family is named here.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from tpzoo.models import hf_rules
from tpzoo.models.config import ModelConfig
from tpzoo.models.families import FAMILIES, HFAdapter
from tpzoo.models.hf_rules import ConversionError, Rule

__all__ = ["ConversionError", "adapter", "architecture_of", "architectures", "config_from_hf", "config_to_hf",
           "model_types", "rules_for", "state_dict_from_hf", "state_dict_to_hf", "tied_repeats"]


def adapters() -> dict[str, HFAdapter]:
    """Hugging Face architecture -> the adapter of the registered family that converts it."""
    return {arch: f.spec.hf for f in FAMILIES.values() if f.spec.hf is not None for arch in f.spec.hf.architectures}


def architectures() -> dict[str, tuple[str, dict[str, Any]]]:
    """Hugging Face architecture -> (tpzoo class, its constructor options), over the registered families."""
    return {arch: a.architectures[arch] for arch, a in adapters().items()}


def model_types() -> tuple[str, ...]:
    """The Hugging Face config ``model_type``s the registered families convert."""
    return tuple(dict.fromkeys(a.model_type for a in adapters().values()))


def adapter(arch: str) -> HFAdapter:
    """The adapter of the family that converts Hugging Face architecture ``arch``."""
    found = adapters()
    if arch not in found:
        raise ConversionError(f"architecture {arch!r} is not supported; supported: {', '.join(found)}")
    return found[arch]


def architecture_of(class_name: str, options: dict[str, Any]) -> str:
    """The Hugging Face architecture of a tpzoo model class with ``options``."""
    for arch, (cls, opts) in architectures().items():
        if cls == class_name and all(options.get(k) == v for k, v in opts.items()):
            return arch
    raise ConversionError(f"no Hugging Face architecture for tpzoo {class_name} with {options}")


def config_from_hf(hf: Any, arch: str) -> ModelConfig:
    """The tpzoo config (of the family's config class) of a Hugging Face config of ``arch``."""
    return adapter(arch).config_from_hf(hf, arch)


def config_to_hf(config: ModelConfig, arch: str) -> Any:
    """The Hugging Face config of a tpzoo config, naming ``arch`` as its architecture."""
    return adapter(arch).config_to_hf(config, arch)


def rules_for(config: ModelConfig, arch: str) -> list[Rule]:
    """The conversion rules of one model: one per tpzoo tensor."""
    return adapter(arch).rules(config, arch)


def state_dict_from_hf(hf_state: dict[str, Tensor], config: ModelConfig, arch: str) -> dict[str, Tensor]:
    """Hugging Face state dict -> tpzoo full state dict (float32). Tied repeats may be absent, as in saved files."""
    return hf_rules.state_dict_from_hf(hf_state, rules_for(config, arch), arch)


def state_dict_to_hf(state: dict[str, Tensor], config: ModelConfig, arch: str) -> dict[str, Tensor]:
    """tpzoo full state dict -> Hugging Face state dict, tied tensors under each of their names."""
    return hf_rules.state_dict_to_hf(state, rules_for(config, arch))


def tied_repeats(config: ModelConfig, arch: str) -> set[str]:
    """Hugging Face names that repeat a tied tensor: saved files leave them out, as Hugging Face does."""
    return hf_rules.tied_repeats(rules_for(config, arch))
