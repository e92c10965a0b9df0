"""``from_hf`` / ``to_hf``: Hugging Face models <-> tpzoo models, at any tp, bit for bit.

    model = from_hf(GPT2LMHeadModel.from_pretrained("gpt2"))   # a transformers model ...
    model = from_hf("path/to/hf-folder")                        # ... or a folder from save_pretrained
    to_hf(model, "out")            # out/config.json + out/model.safetensors; from_pretrained opens it

The architectures are those of the model families' Hugging Face adapters (``mapping.architectures``).
Both work on full state dicts (``tpzoo.models.sharding``), so a model converted at tp=1 loads at
tp=4 and back. Needs the transformers package (the ``test`` extra) only for configs; weights go
through safetensors directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from tpzoo.convert.mapping import (
    ConversionError,
    adapter,
    architecture_of,
    architectures,
    config_from_hf,
    config_to_hf,
    model_types,
    state_dict_from_hf,
    state_dict_to_hf,
    tied_repeats,
)
from tpzoo.models.base import StagedModel
from tpzoo.models.config import ModelConfig
from tpzoo.models.hf_rules import transformers_module
from tpzoo.models.build import build_model
from tpzoo.models.pretrained import FORMAT, model_options, write_once
from tpzoo.models.sharding import load_full_state_dict
from tpzoo.parallel import ParallelMesh, ParallelPlan
from tpzoo.parallel.lora import merge_adapters, recorded_adapters

HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"


def read_hf(path: str | Path) -> tuple[Any, dict[str, Tensor]]:
    """(config, state dict) of a Hugging Face folder: config.json + model.safetensors (or its sharded index)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder: it has no config.json")
    raw = _json(path / "config.json")
    if raw.get("format") == FORMAT:
        raise ConversionError(f"{path} is a tpzoo model folder, not a Hugging Face one; convert it with to-hf")
    if raw.get("model_type") not in model_types():
        raise ConversionError(f"{path}/config.json has model_type {raw.get('model_type')!r}; tpzoo converts "
                              f"{', '.join(map(repr, model_types()))} models")
    config = transformers_module().AutoConfig.from_pretrained(str(path))
    if (path / HF_WEIGHTS).is_file():
        return config, _check_shapes(path, config, _safetensors(path / HF_WEIGHTS))
    if (path / HF_INDEX).is_file():
        state: dict[str, Tensor] = {}
        for f in _shard_files(path / HF_INDEX):
            state.update(_safetensors(path / f))
        return config, _check_shapes(path, config, state)
    raise FileNotFoundError(f"{path} has no {HF_WEIGHTS} (nor {HF_INDEX}); tpzoo reads safetensors only: "
                            f"re-save the model with save_pretrained(..., safe_serialization=True)")


def _shard_files(index: Path) -> list[str]:
    """The files a sharded index names, each a path inside the model folder (never absolute, never through ..:
    an index that reaches outside the folder would read whatever file it names); ConversionError otherwise."""
    weight_map = _json(index).get("weight_map", {})
    files = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else None
    if files is None or not all(isinstance(f, str) for f in files):
        raise ConversionError(f"{index} has no weight_map of tensor names to file names; restore the model's "
                              f"{index.name}")
    for f in files:
        if Path(f).is_absolute() or ".." in Path(f).parts:
            raise ConversionError(f"{index} names {f!r}, a path outside the model folder; a sharded index names "
                                  f"files inside it: restore the model's {index.name}")
    return files


def _check_shapes(path: Path, config: Any, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state``, when each tensor has the shape config.json gives it (the Hugging Face model built on the meta
    device); ConversionError naming the first that does not: such a folder converts into a model no load takes."""
    with torch.device("meta"):
        expected = getattr(transformers_module(), architecture(config))(config).state_dict()
    wrong = [f"{k} is {list(t.shape)}, config.json makes it {list(expected[k].shape)}" for k, t in state.items()
             if k in expected and t.shape != expected[k].shape]
    if wrong:
        raise ConversionError(f"{path}: {len(wrong)} weights disagree with config.json ({wrong[0]}); the config "
                              f"and the weights are of different models: restore the folder's config.json")
    return state


def _json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ConversionError naming the file and the line if it is not one."""
    try:
        data = json.loads(path.read_bytes())
    except UnicodeDecodeError:
        raise ConversionError(f"{path} is not UTF-8 text (a binary file?); restore the model's {path.name}") from None
    except ValueError as e:
        raise ConversionError(f"{path} is not valid JSON (line {e.lineno}: {e.msg}); restore the model's "
                              f"{path.name}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds a JSON {type(data).__name__}, not an object; restore the model's "
                              f"{path.name}")
    return data


def _safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of ``path``; ConversionError naming the file if it is not a safetensors file."""
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise ConversionError(f"{path} is not a readable safetensors file ({e}); re-save or re-download it") from None


def write_hf(path: str | Path, hf_config: Any, hf_state: dict[str, Tensor], drop: set[str]) -> Path:
    """Write config.json and model.safetensors, leaving out the tied repeats ``drop``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(path))
    save_file({k: v.detach().cpu().contiguous() for k, v in hf_state.items() if k not in drop},
              str(path / HF_WEIGHTS), metadata={"format": "pt"})
    return path


def architecture(hf_config: Any) -> str:
    """The one supported architecture a Hugging Face config names."""
    archs, known = list(getattr(hf_config, "architectures", None) or []), architectures()
    if len(archs) != 1 or archs[0] not in known:
        raise ConversionError(f"config.json names architectures {archs}; tpzoo converts exactly one of "
                              f"{', '.join(known)}")
    return archs[0]


def hf_to_tpzoo(hf_config: Any, hf_state: dict[str, Tensor], arch: str | None = None
                ) -> tuple[str, dict[str, Any], ModelConfig, dict[str, Tensor]]:
    """(tpzoo class, options, config, full state dict) of a Hugging Face config and state dict."""
    arch = arch or architecture(hf_config)
    model_type = adapter(arch).model_type
    if getattr(hf_config, "model_type", model_type) != model_type:
        raise ConversionError(f"{arch} takes a config of model_type {model_type!r}, got {hf_config.model_type!r}")
    config = config_from_hf(hf_config, arch)
    class_name, options = architectures()[arch]
    return class_name, dict(options), config, state_dict_from_hf(hf_state, config, arch)


def tpzoo_to_hf(class_name: str, options: dict[str, Any], config: ModelConfig, state: dict[str, Tensor]
                ) -> tuple[Any, dict[str, Tensor], set[str]]:
    """(Hugging Face config, state dict with tied repeats, the names of those repeats)."""
    arch = architecture_of(class_name, options)
    return config_to_hf(config, arch), state_dict_to_hf(state, config, arch), tied_repeats(config, arch)


def saved_layout(model: Any) -> dict[str, Tensor]:
    """A transformers model's state dict as its checkpoints store it: transformers 5 holds some weights otherwise in
    memory (Mixtral's experts stacked, ``mlp.experts.gate_up_proj``) and turns them back when it saves
    (``revert_weight_conversion``); earlier versions hold the saved layout."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return model.state_dict()
    return revert_weight_conversion(model, model.state_dict())


def from_hf(source: Any, plan: ParallelPlan | ParallelMesh | None = None) -> StagedModel:
    """A tpzoo model sharded for ``plan`` (a ``ParallelPlan``, a mesh, or None: ``get_mesh()``) with the
    weights of ``source``: a transformers model of one of ``architectures()`` (GPT2LMHeadModel,
    BertForPreTraining, LlamaForCausalLM, ...), or a folder holding one (config.json +
    model.safetensors). Every tp rank calls it."""
    if isinstance(source, (str, Path)):
        class_name, options, config, state = hf_to_tpzoo(*read_hf(source))
    else:  # the family's rules name the weights as the model holds them, or as its checkpoints do (Mixtral's)
        try:
            class_name, options, config, state = hf_to_tpzoo(source.config, source.state_dict(), type(source).__name__)
        except ConversionError:
            class_name, options, config, state = hf_to_tpzoo(source.config, saved_layout(source), type(source).__name__)
    model = build_model(class_name, config, plan, **options)
    load_full_state_dict(model, state)
    return model


def to_hf(model: StagedModel, out_dir: str | Path) -> Path:
    """Write ``model`` as a Hugging Face folder that ``from_pretrained`` opens (the vocabulary
    padding dropped; LoRA adapters merged into their weights). Every rank calls it; one writes."""
    def write(state: dict[str, Tensor]) -> None:
        if getattr(model, "adapters", None):  # LoRA: W + (alpha / r) B A, what Hugging Face's model holds
            state = merge_adapters(state, recorded_adapters(model.adapters)[0])
        hf_config, hf_state, tied = tpzoo_to_hf(type(model).__name__, model_options(model), model.config, state)
        write_hf(out_dir, hf_config, hf_state, tied)

    write_once(model, write)
    return Path(out_dir)
