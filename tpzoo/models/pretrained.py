"""The tpzoo model folder: the config and the full (tp-independent) weights, loadable at any tp.

    DIR/config.json        {"format": "tpzoo-model", "class": "GPTModel", "options": {...}, "config": {...},
                            "source": null, or the module:NAME of a family from outside tpzoo}
    DIR/model.safetensors  the full state dict (``sharding.full_state_dict``), float32

    model = build_model("LlamaModel", get_preset("llama-tiny"), plan)   # any family's class
    save_pretrained(model, "ckpt")          # every tp rank calls it; tp rank 0 writes
    model = from_pretrained("ckpt")         # built for the current mesh, any tp

``read_pretrained`` / ``write_pretrained`` do the same on plain dicts without a process group
(the converter uses them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from tpzoo.models.base import StagedModel
from tpzoo.models.build import build_model
from tpzoo.models.config import ModelConfig
from tpzoo.models.families import FAMILIES, SOURCES, config_from_dict
from tpzoo.models.sharding import full_state_dict, load_full_state_dict, model_mesh, source_name
from tpzoo.parallel import ParallelMesh, ParallelPlan

FORMAT = "tpzoo-model"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def model_options(model: nn.Module) -> dict[str, Any]:
    """The constructor options (besides config and plan) that rebuild ``model``'s architecture (its
    family's ``SPEC.model_options``, e.g. BERT's ``add_binary_head``); none for a model whose family is not
    registered (a model of one's own, saved and resumed through the engine)."""
    fam = FAMILIES.get(model.config.model_type)
    return fam.spec.model_options(model) if fam is not None else {}


def pretrained_config(path: str | Path, model: type | None = None) -> tuple[str, dict[str, Any], ModelConfig]:
    """(class name, options, config) of a tpzoo model folder, its weights not read; ``model``: as
    ``config_from_dict``."""
    path = Path(path)
    meta_file = path / CONFIG_FILE
    if not meta_file.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a tpzoo model folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        hint = (f"it is a Hugging Face config (model_type {meta['model_type']!r}): convert it with "
                f"python -m tpzoo.convert from-hf" if "model_type" in meta else f"expected format {FORMAT!r}")
        raise ValueError(f"{meta_file} is not a tpzoo model config; {hint}")
    return meta["class"], meta.get("options", {}), config_from_dict(meta["config"], meta.get("source"), model)


def read_pretrained(path: str | Path, model: type | None = None) -> tuple[str, dict[str, Any], ModelConfig,
                                                                         dict[str, Tensor]]:
    """(class name, options, config, full state dict) of a tpzoo model folder; ``model``: as ``config_from_dict``."""
    return (*pretrained_config(path, model), load_file(str(Path(path) / WEIGHTS_FILE)))


def write_pretrained(path: str | Path, class_name: str, options: dict[str, Any], config: ModelConfig,
                     state: dict[str, Tensor]) -> Path:
    """Write a tpzoo model folder (created if missing)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "class": class_name, "options": options, "config": config.to_dict(),
            "source": SOURCES.get(config.model_type)}
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path / WEIGHTS_FILE),
              metadata={"format": "pt"})
    return path


def write_once(model: StagedModel, write: Callable[[dict[str, Tensor]], object]) -> None:
    """Gather ``model``'s full state dict (every rank must call this) and let one rank, the one at
    tp = dp = pp rank 0, ``write`` it; every rank returns once it is written."""
    if not model.is_whole:
        raise ValueError(f"{type(model).__name__} here is a pipeline stage (layers {model.layer_numbers}); "
                         f"saving takes the whole model")
    state = full_state_dict(model)
    mesh = model_mesh(model)
    if mesh.tp_rank == 0 and mesh.dp_cp_rank == 0 and mesh.pp_rank == 0:
        write(state)
    dist.barrier()


def save_pretrained(model: StagedModel, path: str | Path) -> Path:
    """Write ``model`` as a tpzoo model folder (full weights). Every rank calls it; one writes."""
    write_once(model, lambda state: write_pretrained(path, type(model).__name__, model_options(model),
                                                     model.config, state))
    return Path(path)


def load_state(model: StagedModel, state: dict[str, Tensor], *, strict: bool = True) -> list[str]:
    """Load a full state dict into ``model`` or a stage of it (a last stage's tied copy of the word
    embedding takes the embedding's weight); ``strict=False`` returns the parameters left as they were
    (see ``load_full_state_dict``)."""
    picked = {k: state[source_name(k)] for k in model.state_dict() if source_name(k) in state}
    return load_full_state_dict(model, picked, strict=strict)


def from_pretrained(path: str | Path, plan: ParallelPlan | ParallelMesh | None = None, **stage: Any) -> StagedModel:
    """Build the saved model for ``plan`` (a plan, a mesh, or None: ``get_mesh()``), any tp, and load its weights.

    ``stage`` (pre_process, post_process, layers) builds one pipeline stage of it instead.
    """
    class_name, options, config, state = read_pretrained(path)
    model = build_model(class_name, config, plan, **options, **stage)
    load_state(model, state)
    return model
