"""The model in a checkpoint: what meta.json records to rebuild it, the check that an engine's model
matches it, and ``load_model`` (weights only, any mesh, training checkpoints and model folders)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any


from tpzoo.checkpoint.paths import read_meta, resolve_checkpoint
from tpzoo.checkpoint.reader import load_tensors, read_dcp_metadata
from tpzoo.checkpoint.tensors import MODEL_PREFIX, check_finite, finish_load, load_targets, model_entries, split_by_fit
from tpzoo.engine.config import split_layers
from tpzoo.models.base import StagedModel
from tpzoo.models.config import RUN_OPTIONS, ModelConfig
from tpzoo.models.build import build_model
from tpzoo.models.families import SOURCES, config_from_dict
from tpzoo.models.pretrained import CONFIG_FILE, load_state, model_options, read_pretrained
from tpzoo.parallel import ParallelMesh, ParallelPlan, as_plan
from tpzoo.parallel.lora import ADAPTER, add_adapters, recorded_adapters

logger = logging.getLogger(__name__)


def model_record(model: StagedModel) -> dict[str, Any]:
    """meta.json's "model": {"class", "options" (constructor options), "config" (the model config's dict),
    "plan" (the run options it was built with: ``ParallelPlan.options()``, for the record; loading takes
    the loader's plan), "source" (the module:NAME of a family from outside tpzoo, else null), and for a model with
    LoRA adapters "adapters" (their ``LoRAConfig`` and seed). Checkpoints written before the plan kept those options
    inside "config"; before the open registry, "source" was absent."""
    record = {"class": type(model).__name__, "options": model_options(model), "config": model.config.to_dict(),
              "plan": model.plan.options(), "source": SOURCES.get(model.config.model_type)}
    if getattr(model, "adapters", None):  # LoRA (tpzoo.parallel.lora): added again before the weights load
        record["adapters"] = model.adapters
    return record


def recorded_config(record: dict[str, Any], model: type | None = None) -> ModelConfig:
    """The config of a model record (``model_record``), its family registered (else one line naming it) or
    ``model`` a class of it (``config_from_dict``)."""
    return config_from_dict(record["config"], record.get("source"), model)


def check_model_matches(record: dict[str, Any], model: StagedModel, folder: Path) -> None:
    """ValueError naming every difference between the saved model and ``model`` that changes its weights. Needs no
    family registry: a model of one's own, never registered, resumes through the engine as it saved."""
    problems = []
    if record["class"] != type(model).__name__:
        problems.append(f"class: checkpoint {record['class']}, model {type(model).__name__}")
    if record["options"] != model_options(model):
        problems.append(f"options: checkpoint {record['options']}, model {model_options(model)}")
    saved, own = record["config"], model.config.to_dict()
    if saved.get("model_type") == own["model_type"]:  # read as the engine's config class reads it (older layouts)
        saved = type(model.config).from_dict(saved).to_dict()
    problems += [f"{k}: checkpoint {saved.get(k)!r}, model {own.get(k)!r}" for k in {**own, **saved}
                 if k not in RUN_OPTIONS and saved.get(k) != own.get(k)]
    if problems:
        raise ValueError(f"checkpoint {folder} holds another model than the engine's ({'; '.join(problems)}); "
                         f"build the model with the checkpoint's settings (tpzoo.checkpoint.read_meta) or load "
                         f"just its weights with tpzoo.checkpoint.load_model")


def _build(class_name: str, options: dict[str, Any], config: ModelConfig, plan: ParallelPlan,
           model_class: type | str | None, config_overrides: dict[str, Any] | None,
           stage: dict[str, Any]) -> StagedModel:
    """The saved model (or ``model_class``) with ``config_overrides``, as this pp rank's stage of an even
    split when pp > 1 and ``stage`` is not given. The saved constructor options apply to the saved class only."""
    wanted = class_name if model_class is None else model_class
    if getattr(wanted, "__name__", wanted) != class_name:
        options = {}
    config = config.replace(**(config_overrides or {}))
    mesh = plan.mesh
    if not stage and mesh.pp_size > 1:
        layers = split_layers(config.num_layers, mesh.pp_size)[mesh.pp_rank]
        stage = dict(pre_process=mesh.pp_rank == 0, post_process=mesh.pp_rank == mesh.pp_size - 1, layers=layers)
    return build_model(wanted, config, plan, **options, **stage)


def _strict(model: StagedModel, saved_class: str, config_overrides: dict[str, Any] | None) -> bool:
    """Whether every parameter must load: the saved class with the saved config."""
    return type(model).__name__ == saved_class and not config_overrides


def load_model(path: str | Path, plan: ParallelPlan | ParallelMesh | None = None, *,
               model_class: type | str | None = None, config_overrides: dict[str, Any] | None = None,
               **stage: Any) -> StagedModel:
    """Build the saved model for ``plan`` and load its weights, whatever mesh saved them. ``plan``: a
    ``ParallelPlan`` (mesh and run options such as sequence parallelism), a bare mesh (default run
    options) or None (``get_mesh()``).

    ``path``: a training checkpoint (save dir or iter folder; collective: every rank calls this) or a
    tpzoo model folder (config.json + model.safetensors). Any tp; with pp > 1 this pp rank's stage of
    an even split, or the stage that ``stage`` (pre_process, post_process, layers) names.
    ``model_class`` (a class, or a class name of a registered family) replaces the saved class
    (BertModel -> BertForSequenceClassification; a class of a family never registered reads the config
    with its ``config_class``) and/or ``config_overrides`` change the config (e.g.
    {"num_labels": 3}); then parameters whose names and
    shapes match load and the others keep their seeded init, listed in a warning. Without either (or with
    the saved class itself), every parameter must load. A model saved with LoRA adapters gets them again
    (``tpzoo.parallel.lora``; its base weights frozen), and a checkpoint of the adapters alone (``adapters_of``:
    the base checkpoint it was fine-tuned from) loads that base first.
    """
    plan = as_plan(plan)
    mesh = plan.mesh
    path, given = Path(path), model_class if isinstance(model_class, type) else None
    if (path / CONFIG_FILE).is_file():
        class_name, options, config, state = read_pretrained(path, given)
        model = _build(class_name, options, config, plan, model_class, config_overrides, stage)
        fresh = load_state(model, state, strict=_strict(model, class_name, config_overrides))
    else:
        folder = resolve_checkpoint(path, collective=True)
        record = read_meta(folder)["checkpoint"]["model"]
        if record.get("adapters_of"):  # LoRA's adapters alone: the base model's weights come from its checkpoint
            model = load_model(record["adapters_of"], plan, model_class=model_class, config_overrides=config_overrides,
                               **stage)
        else:
            model = _build(record["class"], record["options"], recorded_config(record, given), plan,
                           model_class, config_overrides, stage)
        if record.get("adapters"):
            add_adapters(model, *recorded_adapters(record["adapters"]))
        strict = _strict(model, record["class"], config_overrides)
        saved = read_dcp_metadata(folder).state_dict_metadata
        entries, rest = split_by_fit(model_entries(model, mesh, loading=True), saved)
        if record.get("adapters_of"):  # the base's weights are loaded: only the adapters are this folder's
            rest = [e for e in rest if f".{ADAPTER}.lora_" in e.key]
        if strict and rest:
            raise ValueError(f"checkpoint {folder} lacks {len(rest)} of the model's parameters "
                             f"({', '.join(e.key for e in rest[:5])}{' ...' if len(rest) > 5 else ''})")
        targets = load_targets(entries, mesh)
        load_tensors(targets, folder)
        finish_load(entries, targets, mesh)
        fresh = sorted(e.key.removeprefix(MODEL_PREFIX) for e in rest)
    check_finite(model_entries(model, mesh, loading=True), path, mesh)
    if fresh:
        logger.warning("%s from %s: %d parameters not in the checkpoint (or of another shape) keep their fresh "
                       "init: %s", type(model).__name__, path, len(fresh), ", ".join(fresh))
    return model
