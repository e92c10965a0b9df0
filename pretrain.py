"""Pretrain a model of any family (``--model``, see ``tpzoo.models.families``) on the pp x dp x tp
mesh: ``python pretrain.py`` (a tiny GPT on the demo corpus, a few minutes on a CPU) or
``torchrun --nproc-per-node N pretrain.py --tp .. --pp ..``.
``python pretrain.py --load DIR`` continues a saved run as it was configured.
Flags, schedule, metrics and checkpoints: docs/training.md."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

# OpenMP threads that spin while they wait crawl (20-50x slower steps) on a CPU shared with other
# processes; waiting threads that sleep cost nothing measurable. Set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# light imports only until the flags are checked: a misuse is reported in a fraction of a second
from tpzoo.data.data_args import DataConfig, add_data_args, check_data_flags  # noqa: E402
from tpzoo.models.families import FAMILIES, family  # noqa: E402
from tpzoo.training.architecture_args import add_architecture_args, add_speed_args, resolve_speed  # noqa: E402
from tpzoo.training.args import (CommandParser, add_parallel_args, add_precision_args, add_run_args,  # noqa: E402
                                 check_output_folder, check_save_folder, command_parser, exit_on_misuse,
                                 exit_on_run_error)
from tpzoo.training.checkpoint_args import CheckpointConfig, RunIO, model_folder_record  # noqa: E402
from tpzoo.training.config_file import add_config_args, print_config, to_toml, write_config  # noqa: E402
from tpzoo.training.logging_args import LoggingConfig  # noqa: E402
from tpzoo.training.model_args import ModelChoice, add_model_args, check_preset, pretrain_options  # noqa: E402
from tpzoo.training.monitor import check_logging  # noqa: E402
from tpzoo.training.megatron_refused import add_refused_args  # noqa: E402
from tpzoo.training.optimizer_args import TrainDefaults, add_optimizer_args, set_model_defaults  # noqa: E402
from tpzoo.training.parallel_config import ParallelConfig  # noqa: E402
from tpzoo.training.resolve import resolve_flags  # noqa: E402
from tpzoo.training.run_config import RunConfig, add_section, section_of  # noqa: E402

PROG = "pretrain.py"
# Schedule defaults per --model: each family's train_defaults (tpzoo.models.families, docs/training.md)
MODEL_DEFAULTS = TrainDefaults()


def parser(prog: str = PROG, model: str = "gpt") -> CommandParser:
    """pretrain.py's flags; ``prog`` and the default ``--model`` differ for Megatron-LM's entry-point names
    (pretrain_gpt.py, pretrain_bert.py)."""
    p = command_parser(prog, f"Pretrain a model ({', '.join(FAMILIES)}) on the pp x dp x tp mesh "
                       "(docs/training.md).")
    add_model_args(p, default_model=model)
    add_architecture_args(p)
    add_parallel_args(p)
    add_optimizer_args(p, micro_batch_size=8, global_batch_size=32)
    set_model_defaults(p, MODEL_DEFAULTS)
    add_precision_args(p)
    add_speed_args(p)
    add_data_args(p)
    add_run_args(p)
    add_section(p, CheckpointConfig, "checkpoint (Megatron-LM's flags; docs/checkpoints.md)")
    add_section(p, LoggingConfig, "logging (Megatron-LM's names; docs/training.md)")
    add_config_args(p)
    add_refused_args(p)  # last: a flag defined above is never refused
    return p


def check_flags(args: argparse.Namespace, given: set[str] | None = None) -> RunConfig | None:
    """What the flags alone can be checked for, before torch loads; a new run's flags resolved in place and made
    its run configuration, returned (a resume's are resolved and checked once merged with the checkpoint's: None;
    the launch's --use-torch-fsdp2 is never restored). ``given``: the flags written on the command line (None: all
    of them)."""
    section_of(ParallelConfig, vars(args)).check_launch()
    check_preset(args.preset)
    section_of(CheckpointConfig, vars(args)).check(section_of(RunIO, vars(args)))
    check_data_flags(DataConfig.of(vars(args)), args.model)  # --mask-prob against a --model given
    check_logging(section_of(LoggingConfig, vars(args)))
    for flag in ("save", "log_dir", "data_cache_path", "tensorboard_dir", "wandb_save_dir"):
        check_output_folder(f"--{flag.replace('_', '-')}", getattr(args, flag))
    resumed_into = args.load if args.save is None and args.load is not None and not args.finetune else None
    check_save_folder(args.save or resumed_into)  # a resume saves where its checkpoint is
    folder = model_folder_record(args.load) if args.load is not None else None
    folder_family = folder["config"].get("model_type") if folder is not None else None
    if args.load is not None and folder_family is None:
        resolve_speed(args)  # the launch's own; the others once merged with the checkpoint's (start_run)
        return None
    if folder_family is not None:  # --finetune from a model folder: a new run of its family, its weights to start
        if (given is None or "model" in given) and args.model != folder_family:
            raise ValueError(f"--load {args.load} holds a {folder_family} model but --model is {args.model}; pass "
                             f"--model {folder_family} or leave it out")
        args.model, given = folder_family, None if given is None else {*given, "model"}
    resolve_flags(args, given, None, MODEL_DEFAULTS)  # --model, when not given: the one the architecture flags describe
    saved_as = (folder.get("class", "model"), folder.get("options") or {}) if folder_family is not None else None
    options = pretrain_options(ModelChoice.of(vars(args)), saved_as, args.load)  # --bert-no-binary-head, or refused
    if saved_as is not None:  # the folder's model is built as saved: a head-less one recorded so (a resume builds it)
        args.bert_no_binary_head = family(args.model).without_binary_head(options)
    job = RunConfig.of(vars(args))  # every section's fields
    job.training.lr_schedule(job.training.batches(job.model.seq_length))  # and the batch ramp-up
    job.engine()  # batch sizes ...
    return job


def start_run(args: argparse.Namespace, given: set[str], job: RunConfig | None) -> Any:
    """The ``tpzoo.training.setup.Run`` of the flags: the mesh of the launch's, the checkpoint of --load (every rank
    checks its share), a resume's flags merged with the checkpoint's (``resolve_flags``; ``job``: a new run's
    configuration, resolved by ``check_flags``), built (``build_run``)."""
    from tpzoo.checkpoint import read_meta
    from tpzoo.training.checkpoint_args import checkpoint_to_load
    from tpzoo.training.elastic import place
    from tpzoo.training.fault_tolerance import join_replica_groups, share_run_state
    from tpzoo.training.setup import build_run

    parallel = job.parallel if job else section_of(ParallelConfig, vars(args))  # the launch's: never restored
    if parallel.elastic:  # dp from this launch's world size; a spare rank exits here
        batch = job.training if job else args
        place(parallel, batch.global_batch_size, batch.micro_batch_size)
    mesh = parallel.mesh()
    replicas = join_replica_groups(parallel, mesh) if parallel.fault_tolerance else None  # from now on heartbeating
    if job is not None and job.io.load is not None:  # a model folder (check_flags): its weights start a new run
        return share_run_state(replicas, build_run(job, mesh, weights=Path(job.io.load), replicas=replicas))
    checkpoint = checkpoint_to_load(section_of(RunIO, vars(args)), section_of(CheckpointConfig, vars(args)))
    saved = read_meta(checkpoint) if checkpoint else None  # None also for --save DIR --load DIR before DIR holds one
    changes = []
    if job is None:
        changes = resolve_flags(args, given, None if saved is None else saved.get("args", {}), MODEL_DEFAULTS)
        if saved is not None and args.save is None and not args.finetune:
            args.save = str(checkpoint.parent)  # the run goes on saving where it saved
        job = RunConfig.of(vars(args))
    return share_run_state(replicas, build_run(job, mesh, checkpoint, saved, changes, replicas=replicas))


def main(argv: list[str] | None = None, prog: str = PROG, model: str = "gpt"):
    p = parser(prog, model)
    args, given = p.parse_args(argv), p.given(argv)
    job = exit_on_misuse(prog, lambda: check_flags(args, given))
    import torch.distributed as dist

    from tpzoo.training.loop import train

    if args.print_config:  # the flags as start_run resolves them (a resume's merged with its checkpoint's)
        return exit_on_misuse(prog, lambda: print_config(p, args, lambda saved: job or resolve_flags(
            args, given, saved, MODEL_DEFAULTS), described="model" not in given))

    def run():
        built = start_run(args, given, job)
        described = "model" not in given and built.loaded_from is None
        built.config_file = to_toml(p, built.job.flags, described)  # in the run folder now, in each checkpoint saved
        write_config(built.save_dir, built.config_file)
        return built

    # disk full ...: one line, exit 1; a sharding plan that misdescribes a parameter: one line, exit 2
    summary = exit_on_run_error(prog, lambda: train(exit_on_misuse(prog, run)))
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
