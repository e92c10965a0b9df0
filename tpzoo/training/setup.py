"""What a pretraining run is built from its run configuration (``RunConfig``, resolved by
``tpzoo.training.resolve``), before its first step: the checkpoint to resume (checked against the configuration),
the mesh and plan, the data, the model config and the engine. The ``--model`` family (``tpzoo.models.families``)
gives the data kind, the model class, the presets and the options of a model without its binary head
(``--bert-no-binary-head``, or a model folder or checkpoint saved so: ``pretrain_options``), whose samples then carry
no sentence task.

    run = build_run(job, mesh, checkpoint, saved)   # ValueError/FileNotFoundError on misuse, before any training
    run.engine, run.train, run.valid, run.schedule, run.iteration, run.consumed_samples

Iteration i trains on samples [c, c + B(c)) of the train split, where c = consumed samples before
it and B the batch schedule (``tpzoo.training.batch_schedule``: G, or a ramp-up), the same on every
mesh and after a resume; its lr is the schedule at the samples of the steps taken before it
(``lr_steps``: c less the batches of skipped steps, as Megatron-LM's scheduler counts). A checkpoint records the
run's flags with their files made absolute (``absolute_paths``).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tpzoo.checkpoint import load_checkpoint, load_model
from tpzoo.checkpoint.load import check_saved_parts
from tpzoo.checkpoint.model import recorded_config
from tpzoo.checkpoint.save import mesh_shape
from tpzoo.data.batches import global_batches
from tpzoo.data.build import build_datasets, samples_needed
from tpzoo.data.data_args import run_data
from tpzoo.data.loader import BatchReader
from tpzoo.data.tokenizer import Tokenizer, folder_holds_tokenizer, load_tokenizer
from tpzoo.data.tokenizer_types import tokenizer_of
from tpzoo.engine import Engine
from tpzoo.engine.config import micro_batches
from tpzoo.engine.data_parallel import set_hyperparameters
from tpzoo.engine.fault_tolerance import ReplicaGroups
from tpzoo.models.config import RUN_OPTIONS, ModelConfig
from tpzoo.models.families import family
from tpzoo.models.build import build_model
from tpzoo.models.pretrained import pretrained_config
from tpzoo.parallel import ParallelMesh, manual_seed
from tpzoo.training.batch_schedule import BatchSchedule
from tpzoo.training.elastic import mesh_change
from tpzoo.training.fits import check_state_fits
from tpzoo.training.health import Health
from tpzoo.training.lr_schedule import LRSchedule, earlier_format
from tpzoo.training.metrics import metrics_records
from tpzoo.training.model_args import model_config, pretrain_options
from tpzoo.training.resolve import absolute_paths
from tpzoo.training.run_config import RunConfig


@dataclass
class Run:
    job: RunConfig                  # the resolved configuration
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
    health: Health = field(default_factory=Health)  # which checkpoint trains on (tpzoo.training.health)
    mesh_change: str | None = None  # a resume's line naming the checkpoint's mesh and this one, where they differ

    def batch(self, dataset: Any, start: int, size: int | None = None) -> dict[str, torch.Tensor]:
        """The ``size`` (default: the global batch size G) samples of ``dataset`` from sample ``start`` on
        (BERT's sentence-order label included, unless its samples have no sentence task)."""
        g = self.engine.config.global_batch_size if size is None else size
        if dataset is self.train and self.reader is not None:
            return self.reader.read(start, g)
        return next(global_batches(dataset, g, torch.arange(start, start + g)))

    def meta(self) -> dict[str, Any]:
        """What a checkpoint records besides the tensors (JSON-able)."""
        return dict(model=self.job.model.model, model_config=self.config.to_dict(),
                    tokenizer=self.tokenizer.reference(), data_prefix=self.data_prefix,
                    consumed_samples=self.consumed_samples,
                    lr_schedule=dict(self.schedule.state_dict(), num_steps=self.lr_steps),
                    reference_loss=self.health.reference, args=absolute_paths(self.job.flags))


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


def check_fits_vocabulary(tokenizer: Tokenizer, config: ModelConfig, load: str) -> None:
    """A model folder's vocabulary must hold the tokenizer's ids (it may have more: Hugging Face pads theirs)."""
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"--load {load} holds a model of {config.vocab_size} tokens but the tokenizer "
                         f"{tokenizer.path} has {tokenizer.vocab_size}; pass the model's --tokenizer-model")


def resolve_model_config(job: RunConfig, tokenizer: Tokenizer | None, saved: dict[str, Any] | None,
                         folder: ModelConfig | None = None) -> ModelConfig:
    """The configuration's model config (vocabulary from the tokenizer); with ``saved`` (a checkpoint's meta) or
    ``folder`` (a model folder's config, whose vocabulary the tokenizer may not fill: Hugging Face pads theirs; no
    tokenizer needed) the stored config is the base, and any shape the flags change is a ValueError."""
    choice, load = job.model, job.io.load
    if saved is None and folder is None:
        return model_config(choice, vocab_size=tokenizer.vocab_size)
    if folder is not None:
        stored = folder
    else:
        if saved["model"] != choice.model:
            raise ValueError(f"--load {load} holds a {saved['model']} model but --model is {choice.model}; "
                             f"pass --model {saved['model']}")
        stored = recorded_config(saved["checkpoint"]["model"])
        check_vocabulary(tokenizer, stored, load)
    config = model_config(choice, None if choice.preset else stored, vocab_size=stored.vocab_size)
    differ = differing_fields(stored, config)
    if differ:
        raise ValueError(f"--load {load} holds another model than the flags ask for ({'; '.join(differ)}); "
                         f"drop the model flags that differ or start a new run without --load")
    return config


def default_run_dir(model: str) -> Path:
    """runs/<model>-<time of rank 0>, the same on every rank."""
    name = [f"runs/{model}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def build_run(job: RunConfig, mesh: ParallelMesh, checkpoint: Path | None = None, saved: dict[str, Any] | None = None,
              run_changes: list[str] | None = None, weights: Path | None = None,
              replicas: ReplicaGroups | None = None) -> Run:
    """Everything the run of ``job`` needs on ``mesh``, checked before any training; resumes from ``checkpoint``
    (``saved``: its meta) if given. ``run_changes``: the resume's changes of what the run trains on. ``weights``: a
    model folder whose weights a new run starts from (--load FOLDER --finetune), read with its tokenizer unless the
    flags name one. ``replicas``: this launch's replica group under per-step fault tolerance (its dp slots)."""
    io, model, data = job.io, job.model, job.data
    model_class = family(model.model).spec.pretrain_model
    saved_as = pretrained_config(weights) if weights is not None else None  # the folder's class, options, config
    record = saved["checkpoint"]["model"] if saved is not None else None
    built_as = (saved_as[:2] if saved_as is not None  # the model a folder or checkpoint holds is built as saved
                else (record["class"], record.get("options", {})) if record and record["class"] == model_class else None)
    # before anything else is read: its options, whether it has a binary head (--bert-no-binary-head), which the
    # samples follow
    options = pretrain_options(model, built_as, io.load)
    if saved is not None:
        check_saved_parts(checkpoint, saved["checkpoint"], **job.checkpoint.load_options())  # before data and model
    if io.log_dir or io.save:  # the log a resume appends to: readable, before data and model
        metrics_records(Path(io.log_dir or io.save) / "metrics.jsonl")
    batches = job.training.batches(model.seq_length)
    schedule = job.training.lr_schedule(batches)
    train_iters = job.training.iterations(batches)
    engine_cfg = job.engine()
    slots = mesh.dp_size * (replicas.count if replicas else 1)  # the dp slots of a step's rows
    micro_batches(engine_cfg, slots, mesh.pp_size)  # G, then every size of a ramp-up
    batches.check(engine_cfg.micro_batch_size, slots)
    for size in batches.sizes():  # enough micro-batches for the pipeline schedule
        micro_batches(engine_cfg, slots, mesh.pp_size, size)
    given_tokenizer = tokenizer_of(data.tokenizer)  # the tokenizer flags', or None
    folder = saved_as[2] if saved_as is not None else None
    if folder is not None:  # the folder's model against the flags, before any data is read
        config = resolve_model_config(job, None, None, folder)
        if given_tokenizer is None and folder_holds_tokenizer(weights):
            given_tokenizer = load_tokenizer(weights)
        if given_tokenizer is not None:  # else the data's own, checked once read
            check_fits_vocabulary(given_tokenizer, config, io.load)
    if saved is not None and given_tokenizer:  # before any data is tokenised with it
        check_vocabulary(given_tokenizer, recorded_config(saved["checkpoint"]["model"]), io.load)
    plan = job.plan(mesh)
    manual_seed(job.training.seed, mesh)
    tokenizer, prefix, sources = run_data(data, model.model, given_tokenizer)
    if folder is None:
        config = resolve_model_config(job, tokenizer, saved)
    elif given_tokenizer is None:  # the data's own tokenizer
        check_fits_vocabulary(tokenizer, config, io.load)
    check_state_fits(config, engine_cfg, mesh, plan.fsdp)  # before any sample index or weight is allocated
    resumed = saved if saved is not None and not job.checkpoint.finetune else None  # --finetune: from iteration 0
    consumed = resumed["consumed_samples"] if resumed else 0
    train_iters_left = max(0, train_iters - (resumed["iteration"] if resumed else 0))
    needed = samples_needed(train_iters, engine_cfg.global_batch_size, io.eval_interval, io.eval_iters)
    needed = (max(batches.consumed_after(train_iters), batches.consumed_after(train_iters_left, consumed)),
              needed[1], 0)  # pretraining never reads the test split
    sentence_task = {"binary_head": None} if family(model.model).without_binary_head(options) else {}
    train, valid, _ = build_datasets(model.model, tokenizer, prefix, model.seq_length, job.training.seed, needed,
                                     data.split, sources, data.document_marks(tokenizer.eod),
                                     **data.masked_lm_options(), **sentence_task)
    if folder is not None:  # the folder's weights; the flags' run options (dropout ...) apply
        stored = folder.to_dict()
        overrides = {k: v for k, v in config.to_dict().items() if stored[k] != v}
        build = functools.partial(load_model, weights, model_class=model_class, config_overrides=overrides)
    else:
        build = functools.partial(build_model, model_class, config, **options)
    engine = Engine(build, config, engine_cfg, plan, replicas)
    save_dir = Path(io.save) if io.save else default_run_dir(family(model.model).name)
    run = Run(job, mesh, tokenizer, prefix, config, engine, schedule, batches, train_iters, train, valid, save_dir,
              Path(io.log_dir) if io.log_dir else save_dir)
    run.reader = BatchReader(train, data.num_workers, batches.batch_at) if data.num_workers else None
    if weights is not None:
        run.loaded_from, run.health = weights, Health(pending=str(weights))  # its weights judged by the first step
    if checkpoint is not None:
        loaded = load_checkpoint(checkpoint, engine, **job.checkpoint.load_options())
        set_hyperparameters(engine.optimizer, engine_cfg)  # the flags' betas, eps, momentum, not the saved groups'
        run.loaded_from = checkpoint
        # the loaded weights are judged by their first step; a resumed run by its own first loss
        run.health = Health(pending=str(checkpoint), reference=loaded.get("reference_loss") if resumed else None)
        if resumed:
            run.iteration, run.consumed_samples = loaded["iteration"], loaded["consumed_samples"]
            state, g = loaded["lr_schedule"], engine_cfg.global_batch_size
            run.lr_steps = run.consumed_samples + g if earlier_format(state) else state["num_steps"]
            run.lr_schedule_changes = schedule.changes_from(state, g)
            run.run_changes = run_changes or []
            run.mesh_change = mesh_change(saved["checkpoint"]["mesh"], mesh_shape(engine), run.iteration)
    return run
