"""What a pretraining run is built from, before its first step: the checkpoint to resume (checked
against the flags), the mesh and plan, the data, the model config and the engine. The ``--model``
family (``tpzoo.models.families``) gives the data kind, the model class and the presets.

    run = build_run(args)        # raises ValueError/FileNotFoundError on misuse, before any training
    run.engine, run.train, run.valid, run.schedule, run.iteration, run.consumed_samples

Iteration i trains on samples [c, c + B(c)) of the train split, where c = consumed samples before
it and B the batch schedule (``tpzoo.training.batch_schedule``: G, or a ramp-up), the same on every
mesh and after a resume; its lr is the schedule at the samples of the steps taken before it
(``lr_steps``: c less the batches of skipped steps, as Megatron-LM's scheduler counts).

A resume (``--load``) continues the run as it was configured: every flag the checkpoint recorded
(model, tokenizer, data and split, sequence length, batch sizes, schedule, seed, precision, intervals)
is taken from it unless written on the command line (``given``); the mesh and the speed options
(``LAUNCH_FLAGS``) belong to each launch. Flags given that change what the run trains on
(``MEANING_FLAGS``) are named in ``Run.run_changes``.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tpzoo.checkpoint import load_checkpoint, read_meta
from tpzoo.checkpoint.load import check_saved_parts
from tpzoo.checkpoint.model import recorded_config
from tpzoo.data.batches import global_batches
from tpzoo.data.build import build_datasets, samples_needed
from tpzoo.data.data_args import DATA_GIVEN_TOGETHER, DATA_MEANING_FLAGS, DATA_PATH_FLAGS, DataConfig, run_data
from tpzoo.data.loader import BatchReader
from tpzoo.data.sources import absolute_specs
from tpzoo.data.tokenizer import Tokenizer
from tpzoo.data.tokenizer_types import tokenizer_of
from tpzoo.engine import Engine
from tpzoo.engine.config import micro_batches
from tpzoo.engine.data_parallel import set_hyperparameters
from tpzoo.models.config import RUN_OPTIONS, ModelConfig
from tpzoo.models.families import family
from tpzoo.models.build import build_model
from tpzoo.parallel import ParallelMesh, init_mesh, manual_seed
from tpzoo.training.architecture_args import resolve_architecture, resolve_speed
from tpzoo.training.args import model_config
from tpzoo.training.batch_schedule import BatchSchedule
from tpzoo.training.checkpoint_args import CheckpointConfig, RunIO, checkpoint_to_load
from tpzoo.training.lr_schedule import LRSchedule, earlier_format
from tpzoo.training.optimizer_args import check_optimizer_resume, fill_schedule_defaults, resolve_global_batch_size
from tpzoo.training.parallel_config import ParallelConfig
from tpzoo.training.run_config import SECTIONS, RunConfig, role, section_of


@dataclass
class Run:
    args: argparse.Namespace
    job: RunConfig                  # the resolved flags' sections
    mesh: ParallelMesh
    tokenizer: Tokenizer
    data_prefix: str
    config: ModelConfig
    engine: Engine
    schedule: LRSchedule
    batches: BatchSchedule          # the global batch size of each iteration
    train_iters: int                # the iteration the run ends at (--train-iters, or from --train-samples)
    train: Any                      # map-style dataset of dicts of [s] tensors
    valid: Any                      # likewise, or None without evaluation
    save_dir: Path
    log_dir: Path
    iteration: int = 0              # optimizer steps done
    consumed_samples: int = 0       # train samples read so far: the data position
    lr_steps: int = 0               # samples of the steps taken (not skipped): where the lr schedule is
    loaded_from: Path | None = None
    lr_schedule_changes: list[str] = field(default_factory=list)  # flags vs the resumed checkpoint
    run_changes: list[str] = field(default_factory=list)          # MEANING_FLAGS given that differ from it
    reader: BatchReader | None = None  # --num-workers: the train batches read ahead by DataLoader workers
    config_file: str = ""           # the resolved flags as a --config file, kept in the run folder and each checkpoint

    def batch(self, dataset: Any, start: int, size: int | None = None) -> dict[str, torch.Tensor]:
        """The ``size`` (default: the global batch size G) samples of ``dataset`` from sample ``start`` on
        (BERT's sentence-order label included)."""
        g = self.engine.config.global_batch_size if size is None else size
        if dataset is self.train and self.reader is not None:
            return self.reader.read(start, g)
        return next(global_batches(dataset, g, torch.arange(start, start + g)))

    def meta(self) -> dict[str, Any]:
        """What a checkpoint records besides the tensors (JSON-able)."""
        return dict(model=self.args.model, model_config=self.config.to_dict(), tokenizer=self.tokenizer.reference(),
                    data_prefix=self.data_prefix, consumed_samples=self.consumed_samples,
                    lr_schedule=dict(self.schedule.state_dict(), num_steps=self.lr_steps),
                    args=absolute_paths(vars(self.args)))


# flags of one launch, not of the run: a resume never takes them from the checkpoint (the sections' launch fields)
LAUNCH_FLAGS = frozenset({*role("launch", *SECTIONS.values()), "default_model", "num_workers"})
# a flag given on the command line also keeps these from being restored (another data source brings its own tokenizer)
GIVEN_TOGETHER = {**{k: set(v) for k, v in role("together", *SECTIONS.values()).items()}, **DATA_GIVEN_TOGETHER}
# flags that change what the run trains on: a resume that changes one says so
MEANING_FLAGS = ("seq_length", *DATA_MEANING_FLAGS, "seed")
PATH_FLAGS = (*DATA_PATH_FLAGS, "log_dir", *role("path", *SECTIONS.values()))


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


def differing_fields(saved: ModelConfig, wanted: ModelConfig) -> list[str]:
    """``field checkpoint X, flags Y`` for each weight-shaping field that differs."""
    a, b = saved.to_dict(), wanted.to_dict()
    return [f"{k}: checkpoint {a[k]}, flags {b[k]}" for k in a if k not in RUN_OPTIONS and a[k] != b[k]]


def check_vocabulary(tokenizer: Tokenizer, stored: ModelConfig, load: str) -> None:
    """A resumed model's vocabulary must be the tokenizer's: ValueError naming both sizes."""
    if tokenizer.vocab_size != stored.vocab_size:
        raise ValueError(f"--load {load} holds a model of {stored.vocab_size} tokens but the tokenizer "
                         f"{tokenizer.path} has {tokenizer.vocab_size}; resume with the checkpoint's tokenizer "
                         f"(leave out --tokenizer-model and the data flags) or start a new run without --load")


def resolve_model_config(args: argparse.Namespace, tokenizer: Tokenizer, saved: dict[str, Any] | None
                         ) -> ModelConfig:
    """The flags' model config (vocabulary from the tokenizer; Megatron-LM's architecture flags:
    ``args.architecture_changes``); with ``saved`` (a checkpoint's meta) the checkpoint's config is the
    base, and any shape the flags change is a ValueError."""
    changes = dict(args.architecture_changes, vocab_size=tokenizer.vocab_size)
    if saved is None:
        return model_config(args, **changes)
    if saved["model"] != args.model:
        raise ValueError(f"--load {args.load} holds a {saved['model']} model but --model is {args.model}; "
                         f"pass --model {saved['model']}")
    stored = recorded_config(saved["checkpoint"]["model"])
    config = model_config(args, None if args.preset else stored, **changes)
    check_vocabulary(tokenizer, stored, args.load)
    differ = differing_fields(stored, config)
    if differ:
        raise ValueError(f"--load {args.load} holds another model than the flags ask for ({'; '.join(differ)}); "
                         f"drop the model flags that differ or start a new run without --load")
    return config


def default_run_dir(model: str) -> Path:
    """runs/<model>-<time of rank 0>, the same on every rank."""
    name = [f"runs/{model}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])


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


def build_run(args: argparse.Namespace, given: set[str] | None = None,
              model_defaults: dict[str, dict[str, Any]] | None = None) -> Run:
    """Everything a run needs, checked before any training; resumes from ``--load`` if given.

    ``given``: the flags written on the command line (all of them when None); a resume takes the
    others from the checkpoint. ``model_defaults``: per ``--model``, values for the flags still None."""
    parallel = section_of(ParallelConfig, vars(args))  # the launch's: never restored
    mesh = init_mesh(parallel.tp, parallel.pp, parallel.dp, timeout=parallel.timeout)
    # every rank checks its share of the checkpoint's files (the mesh flags are the launch's, never restored)
    launch = section_of(CheckpointConfig, vars(args))
    checkpoint = checkpoint_to_load(section_of(RunIO, vars(args)), launch)  # None also for --save DIR --load DIR before DIR holds one
    saved = read_meta(checkpoint) if checkpoint else None
    changes = resolve_flags(args, given, None if saved is None else saved.get("args", {}), model_defaults)
    if saved is not None:
        check_saved_parts(checkpoint, saved["checkpoint"], **launch.load_options())  # before the data and model
        if args.save is None and not args.finetune:
            args.save = str(checkpoint.parent)  # the run goes on saving where it saved
    job = RunConfig.of(vars(args))
    batches = BatchSchedule.of(job.training, args.seq_length)
    schedule = LRSchedule.of(job.training, batches)
    train_iters = job.training.iterations(batches)
    engine_cfg = job.engine()
    micro_batches(engine_cfg, mesh.dp_size, mesh.pp_size)  # G, then every size of a ramp-up
    batches.check(engine_cfg.micro_batch_size, mesh.dp_size)
    for size in batches.sizes():  # enough micro-batches for the pipeline schedule
        micro_batches(engine_cfg, mesh.dp_size, mesh.pp_size, size)
    data = DataConfig.of(vars(args))  # the data flags' values, restored ones included
    given_tokenizer = tokenizer_of(data.tokenizer)  # the tokenizer flags', or None
    if saved is not None and given_tokenizer:  # before any data is tokenised with it
        check_vocabulary(given_tokenizer, recorded_config(saved["checkpoint"]["model"]), args.load)
    plan = job.plan(mesh)
    manual_seed(args.seed, mesh)
    tokenizer, prefix, sources = run_data(data, args.model, given_tokenizer)
    config = resolve_model_config(args, tokenizer, saved)
    resumed = saved if saved is not None and not args.finetune else None  # --finetune: from iteration 0
    consumed = resumed["consumed_samples"] if resumed else 0
    train_iters_left = max(0, train_iters - (resumed["iteration"] if resumed else 0))
    needed = samples_needed(train_iters, engine_cfg.global_batch_size, args.eval_interval, args.eval_iters)
    needed = (max(batches.consumed_after(train_iters), batches.consumed_after(train_iters_left, consumed)),
              needed[1], 0)  # pretraining never reads the test split
    train, valid, _ = build_datasets(args.model, tokenizer, prefix, args.seq_length, args.seed, needed, args.split,
                                     sources)
    engine = Engine(functools.partial(build_model, family(args.model).spec.pretrain_model, config), config,
                    engine_cfg, plan)
    save_dir = Path(args.save) if args.save else default_run_dir(family(args.model).name)
    run = Run(args, job, mesh, tokenizer, prefix, config, engine, schedule, batches, train_iters, train, valid, save_dir,
              Path(args.log_dir) if args.log_dir else save_dir)
    run.reader = BatchReader(train, args.num_workers, batches.batch_at) if args.num_workers else None
    if checkpoint is not None:
        loaded = load_checkpoint(checkpoint, engine, **launch.load_options())
        set_hyperparameters(engine.optimizer, engine_cfg)  # the flags' betas, eps, momentum, not the saved groups'
        run.loaded_from = checkpoint
        if resumed:
            run.iteration, run.consumed_samples = loaded["iteration"], loaded["consumed_samples"]
            state, g = loaded["lr_schedule"], engine_cfg.global_batch_size
            run.lr_steps = run.consumed_samples + g if earlier_format(state) else state["num_steps"]
            run.lr_schedule_changes = schedule.changes_from(state, g)
            run.run_changes = changes
    return run
