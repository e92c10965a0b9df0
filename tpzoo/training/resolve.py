"""pretrain.py's flags resolved in place, once, in one place (``resolve_flags``), before the run configuration is
made of them (``RunConfig.of``): a resume's merged with the checkpoint's flags, Megatron-LM's architecture and speed
flags mapped onto tpzoo's, the family's schedule defaults and a batch-size schedule's global batch size filled in.

    resolve_flags(args, given, saved_args, MODEL_DEFAULTS)   # saved_args: --load's recorded flags, or None
    job = RunConfig.of(vars(args))

A resume (``--load``) continues the run as it was configured: every flag the checkpoint recorded
(model, tokenizer, data and split, sequence length, batch sizes, schedule, seed, precision, intervals)
is taken from it unless written on the command line (``given``); the mesh and the speed options
(``LAUNCH_FLAGS``: the sections' launch fields) belong to each launch. A flag given also keeps those it goes with
from being restored (``GIVEN_TOGETHER``: the sections' together fields, another data source's tokenizer). Flags
given that change what the run trains on (``MEANING_FLAGS``) are named in ``Run.run_changes``; a checkpoint
records the flags with their files absolute (``absolute_paths``). Imports without torch.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from tpzoo.data.data_args import DataConfig
from tpzoo.data.sources import absolute_specs
from tpzoo.models.families import family
from tpzoo.training.architecture_args import ArchitectureConfig, resolve_architecture, resolve_speed
from tpzoo.training.model_args import ModelFlags
from tpzoo.training.optimizer_args import check_optimizer_resume, fill_schedule_defaults, resolve_global_batch_size
from tpzoo.training.run_config import SECTIONS, role

_ALL = (ModelFlags, DataConfig, ArchitectureConfig, *SECTIONS.values())  # the sections whose fields have roles
# flags of one launch, not of the run: a resume never takes them from the checkpoint (the sections' launch fields,
# and the script's default family, which no flag sets)
LAUNCH_FLAGS = frozenset({*role("launch", *_ALL), "default_model"})
# a flag given on the command line also keeps these from being restored (another data source brings its own tokenizer)
GIVEN_TOGETHER = {name: set(others) - {name} for name, others in role("together", *_ALL).items()}
# flags naming files: a checkpoint records them absolute (``absolute_paths``)
PATH_FLAGS = tuple(role("path", *_ALL))
# flags that change what the run trains on: a resume that changes one says so
MEANING_FLAGS = tuple(role("meaning", *_ALL))
# each field's check, by flag destination: a checkpoint's recorded value is checked as the flag's would be
CHECKS = role("check", *_ALL)


def absolute_paths(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with its file flags (``PATH_FLAGS``, ``--dataset`` entries) made absolute, so that a
    checkpoint's flags name the same files from any working directory."""
    out = dict(args)
    for name in PATH_FLAGS:
        if isinstance(out.get(name), str):  # a --data-path blend's prefixes are absolute already
            out[name] = os.path.abspath(out[name])
    if out.get("dataset"):
        out["dataset"] = absolute_specs(out["dataset"])  # a dataset name stays a name
    return out


def restore_args(args: argparse.Namespace, given: set[str], saved: dict[str, Any]) -> list[str]:
    """Set every flag of ``args`` not in ``given`` (nor in ``LAUNCH_FLAGS``) to its value in ``saved``
    (a checkpoint's recorded flags; ValueError naming a value its field's check refuses); returns ``--flag now (checkpoint: before)`` for each given
    ``MEANING_FLAGS`` flag whose value differs from the checkpoint's."""
    kept = set(given) | LAUNCH_FLAGS
    for name in given:
        kept |= GIVEN_TOGETHER.get(name, set())
    for name, value in saved.items():
        if name not in kept and hasattr(args, name):
            if name in CHECKS and (problem := CHECKS[name](value)):
                flag = f"--{name.replace('_', '-')}"
                raise ValueError(f"--load {args.load}: its meta.json records {flag} {value!r}, which {problem}; the "
                                 f"checkpoint's meta.json is damaged: restore it, or give {flag} on the command line")
            setattr(args, name, value)
    now = absolute_paths(vars(args))
    return [f"--{name.replace('_', '-')} {_show(now[name])} (checkpoint: {_show(saved.get(name))})"
            for name in MEANING_FLAGS if name in given and now.get(name) != saved.get(name)]


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def check_recorded_family(model: str, load: str) -> None:
    """A resume takes ``--model`` from the checkpoint where not given: ValueError when that names a family from
    outside tpzoo that this process has not registered (only a --model the user gives imports a module)."""
    try:
        family(model)
    except ValueError:
        raise ValueError(f"--load {load} holds a model of --model {model}, a family from outside tpzoo that is not "
                         f"loaded here; pass --model {model} to load it (tpzoo never imports a module that a "
                         f"checkpoint names)") from None


def resolve_flags(args: argparse.Namespace, given: set[str] | None, saved_args: dict[str, Any] | None,
                  model_defaults: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Resolve the run's flags in place, once, in this order: on a resume (``saved_args``: the checkpoint's recorded
    flags) those not ``given`` restored from it and checked against it; Megatron-LM's architecture and speed flags
    (``resolve_architecture``, ``resolve_speed``); the family's schedule defaults (``model_defaults``); the global
    batch size of a batch-size schedule. Returns the resume's changes of ``MEANING_FLAGS`` (``restore_args``)."""
    changes = []
    if saved_args is not None:
        changes = restore_args(args, set(vars(args)) if given is None else given, saved_args)
        check_recorded_family(args.model, args.load)
        check_optimizer_resume(args, saved_args)
    resolve_architecture(args)
    resolve_speed(args)
    if model_defaults:
        fill_schedule_defaults(args, model_defaults)
    resolve_global_batch_size(args, given)  # --step-batch-size-schedule without --global-batch-size
    return changes
