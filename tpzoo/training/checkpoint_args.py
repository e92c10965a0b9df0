"""Megatron-LM's checkpoint flags, and which checkpoint a run loads (docs/checkpoints.md).

    --finetune                     load the model weights only: iteration 0, consumed samples 0, a fresh
                                   optimizer and lr schedule, the RNG as seeded; saves go to --save (or a
                                   new runs/ folder), never into the loaded one
    --no-load-optim / --no-load-rng  resume without the optimizer state (and loss scale) / the RNG states
    --no-save-optim / --no-save-rng  save without them (meta.json says so; loading such a checkpoint then
                                   needs --no-load-optim / --no-load-rng or --finetune, else one line naming it)
    --use-checkpoint-args          accepted: --load always takes the checkpoint's flags (those not given)
    --exit-on-missing-checkpoint   the --save DIR --load DIR idiom below is an error instead

``--save DIR --load DIR`` with DIR holding no checkpoint yet (missing or without iteration folders)
starts from scratch with one printed line, as Megatron-LM does, so one launch line starts a run and
resumes it; ``--load`` naming a missing folder that is not ``--save`` stays an error (exit status 2).
The flags are the launch's: a resume never takes them from the checkpoint.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

FLAGS = ("finetune", "no_load_optim", "no_load_rng", "no_save_optim", "no_save_rng", "use_checkpoint_args",
         "exit_on_missing_checkpoint")


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoint (Megatron-LM's flags; docs/checkpoints.md)")
    g.add_argument("--finetune", action="store_true", help="load only the model weights of --load: iteration 0, "
                   "fresh optimizer, no RNG, consumed samples 0")
    g.add_argument("--no-load-optim", action="store_true", help="resume without the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="resume without the RNG states")
    g.add_argument("--no-save-optim", action="store_true", help="save without the optimizer state")
    g.add_argument("--no-save-rng", action="store_true", help="save without the RNG states")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="accepted: --load always takes the checkpoint's flags (those not given)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="--load DIR that holds no checkpoint is an error even when it is the --save DIR")


def check_checkpoint_flags(args: argparse.Namespace) -> None:
    """ValueError for --finetune or --use-checkpoint-args without --load (they say what to load from it)."""
    for flag in ("finetune", "use_checkpoint_args"):
        if getattr(args, flag) and args.load is None:
            raise ValueError(f"--{flag.replace('_', '-')} reads the checkpoint of --load; add --load DIR")


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """``load_checkpoint``'s options of the flags."""
    return dict(load_optimizer=not (args.finetune or args.no_load_optim),
                load_rng=not (args.finetune or args.no_load_rng))


def save_options(args: argparse.Namespace) -> dict[str, Any]:
    """``save_checkpoint``'s options of the flags."""
    return dict(save_optimizer=not args.no_save_optim, save_rng=not args.no_save_rng)


def holds_no_checkpoint(path: Path) -> bool:
    """True when ``path`` is missing, or a folder with neither ``latest``, iteration folders nor a
    checkpoint's own files (what a first run's --save folder looks like)."""
    from tpzoo.checkpoint.paths import LATEST_FILE, META_FILE, NAME

    if not path.exists():
        return True
    return path.is_dir() and not any(p.name in (LATEST_FILE, META_FILE) or NAME.fullmatch(p.name)
                                     for p in path.iterdir())


def first_run(args: argparse.Namespace) -> bool:
    """Whether --load is the --save folder and holds no checkpoint yet (Megatron-LM's one launch line that starts
    a run and resumes it)."""
    return (args.save is not None and os.path.abspath(args.save) == os.path.abspath(args.load)
            and holds_no_checkpoint(Path(args.load)))


def checkpoint_to_load(args: argparse.Namespace) -> Path | None:
    """The checkpoint folder of --load (collective: every rank checks its share), or None: no --load,
    or --load is the --save folder and holds no checkpoint yet (a first run; printed on rank 0) unless
    --exit-on-missing-checkpoint. FileNotFoundError / ValueError as ``resolve_checkpoint`` otherwise."""
    import torch.distributed as dist

    from tpzoo.checkpoint import resolve_checkpoint

    if args.load is None:
        return None
    if first_run(args):
        if args.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"--load {args.load} holds no checkpoint and --exit-on-missing-checkpoint is "
                                    f"given; drop that flag to start from scratch there")
        if dist.get_rank() == 0:
            print(f"no checkpoint in --load {args.load} (also the --save folder): starting from scratch", flush=True)
        return None
    return resolve_checkpoint(args.load, collective=True)
