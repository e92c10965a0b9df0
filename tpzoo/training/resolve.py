"""pretrain.py's flags resolved once, in one place, into the run configuration (``RunConfig``), and the run
started from it (``start_run``): the mesh of the launch's flags, the checkpoint of ``--load``, the flags merged with
the checkpoint's, Megatron-LM's architecture and speed flags mapped onto tpzoo's, the family's schedule defaults and
a batch-size schedule's global batch size; then ``tpzoo.training.setup.build_run`` builds the run of the
configuration.

    run = start_run(args, given, MODEL_DEFAULTS)   # ValueError/FileNotFoundError on misuse, before any training

A resume (``--load``) continues the run as it was configured: every flag the checkpoint recorded
(model, tokenizer, data and split, sequence length, batch sizes, schedule, seed, precision, intervals)
is taken from it unless written on the command line (``given``); the mesh and the speed options
(``LAUNCH_FLAGS``: the sections' launch fields) belong to each launch. A flag given also keeps those it goes with
from being restored (``GIVEN_TOGETHER``: the sections' together fields, another data source's tokenizer). Flags
given that change what the run trains on (``MEANING_FLAGS``) are named in ``Run.run_changes``.
"""

from __future__ import annotations

import argparse
from typing import Any

from tpzoo.checkpoint import read_meta
from tpzoo.data.data_args import DATA_GIVEN_TOGETHER, DATA_MEANING_FLAGS
from tpzoo.models.families import family
from tpzoo.parallel import init_mesh
from tpzoo.training.architecture_args import resolve_architecture, resolve_speed
from tpzoo.training.checkpoint_args import CheckpointConfig, RunIO, checkpoint_to_load
from tpzoo.training.optimizer_args import check_optimizer_resume, fill_schedule_defaults, resolve_global_batch_size
from tpzoo.training.parallel_config import ParallelConfig
from tpzoo.training.run_config import SECTIONS, RunConfig, role, section_of
from tpzoo.training.setup import Run, absolute_paths, build_run

# flags of one launch, not of the run: a resume never takes them from the checkpoint (the sections' launch fields)
LAUNCH_FLAGS = frozenset({*role("launch", *SECTIONS.values()), "default_model", "num_workers"})
# a flag given on the command line also keeps these from being restored (another data source brings its own tokenizer)
GIVEN_TOGETHER = {**{k: set(v) for k, v in role("together", *SECTIONS.values()).items()}, **DATA_GIVEN_TOGETHER}
# flags that change what the run trains on: a resume that changes one says so
MEANING_FLAGS = ("seq_length", *DATA_MEANING_FLAGS, *role("meaning", *SECTIONS.values()))


def restore_args(args: argparse.Namespace, given: set[str], saved: dict[str, Any]) -> list[str]:
    """Set every flag of ``args`` not in ``given`` (nor in ``LAUNCH_FLAGS``) to its value in ``saved``
    (a checkpoint's recorded flags); returns ``--flag now (checkpoint: before)`` for each given
    ``MEANING_FLAGS`` flag whose value differs from the checkpoint's."""
    kept = set(given) | LAUNCH_FLAGS
    for name in given:
        kept |= GIVEN_TOGETHER.get(name, set())
    for name, value in saved.items():
        if name not in kept and hasattr(args, name):
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


def start_run(args: argparse.Namespace, given: set[str] | None = None,
              model_defaults: dict[str, dict[str, Any]] | None = None) -> Run:
    """The run of ``args``, resolved in place (``resolve_flags``) and built (``build_run``); resumes from ``--load``
    if given. ``given``: the flags written on the command line (all of them when None); a resume takes the others
    from the checkpoint. ``model_defaults``: per ``--model``, values for the flags still None."""
    parallel = section_of(ParallelConfig, vars(args))  # the launch's: never restored
    mesh = init_mesh(parallel.tp, parallel.pp, parallel.dp, timeout=parallel.timeout)
    # every rank checks its share of the checkpoint's files
    checkpoint = checkpoint_to_load(section_of(RunIO, vars(args)), section_of(CheckpointConfig, vars(args)))
    saved = read_meta(checkpoint) if checkpoint else None  # None also for --save DIR --load DIR before DIR holds one
    changes = resolve_flags(args, given, None if saved is None else saved.get("args", {}), model_defaults)
    if saved is not None and args.save is None and not args.finetune:
        args.save = str(checkpoint.parent)  # the run goes on saving where it saved
    return build_run(RunConfig.of(vars(args)), mesh, checkpoint, saved, changes)
