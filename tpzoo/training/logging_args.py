"""Megatron-LM's logging flags (its ``LoggerConfig``): TensorBoard, Weights & Biases, throughput, the
params norm, zeros in the gradients and the timers. ``--log-interval`` and ``--log-dir`` stay with the
run flags (``tpzoo.training.args.add_run_args``); what each flag adds to a metrics line:
``tpzoo.training.metrics`` (fields) and ``tpzoo.training.monitor`` (writers).

Checked before torch loads (``check_logging_flags``): a flag whose library is not installed, a
``--wandb-*`` flag without ``--wandb-project``, ``--wandb-project`` online without a W&B API key.
"""

from __future__ import annotations

import argparse

from tpzoo.flag_types import positive_int

TIMING_LEVELS = (0, 1, 2)
TIMING_OPTIONS = ("max", "minmax", "all")
WANDB_FLAGS = ("wandb_exp_name", "wandb_save_dir", "wandb_entity")


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """``--tensorboard-dir --tensorboard-log-interval --tensorboard-queue-size --log-*-to-tensorboard
    --log-throughput --log-params-norm --log-num-zeros-in-grad --timing-log-level --timing-log-option
    --wandb-project --wandb-exp-name --wandb-save-dir --wandb-entity`` (Megatron-LM's names and meanings)."""
    g = parser.add_argument_group("logging (Megatron-LM's names; docs/training.md)")
    g.add_argument("--tensorboard-dir", metavar="DIR", help="TensorBoard events here (needs tensorboard; default: "
                   "the log dir when tensorboard is installed)")
    g.add_argument("--tensorboard-log-interval", type=positive_int, metavar="N",
                   help="also write the train scalars to TensorBoard / W&B every N iterations (default: the "
                   "logged lines only)")
    g.add_argument("--tensorboard-queue-size", type=positive_int, default=1000, metavar="N",
                   help="events TensorBoard queues before it writes them to disk")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write the timers (time/<name>) and the throughput to TensorBoard / W&B too")
    g.add_argument("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
                   dest="log_loss_scale_to_tensorboard", action="store_false",
                   help="leave the loss scale out of TensorBoard / W&B")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="log the validation perplexity exp(val loss) as val_ppl")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="log rank 0's memory: CUDA allocated / peak / reserved bytes, a CPU process's peak RSS")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true", help="log the world size")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="older Megatron-LM's flag; tpzoo always logs the global batch size (global_batch_size)")
    g.add_argument("--log-throughput", action="store_true",
                   help="log the throughput: model TFLOP/s per GPU (6 x params + attention, per token)")
    g.add_argument("--log-params-norm", action="store_true",
                   help="log the L2 norm of all weights after each logged step (each weight counted once)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="log the number of zero entries of the reduced gradients (each counted once)")
    g.add_argument("--timing-log-level", type=int, choices=TIMING_LEVELS, metavar="{0,1,2}",
                   help="time the iteration (0), its forward-backward, gradient sync, optimizer, evaluation and "
                   "save (1), and the batch read (2); logged as time/<name> seconds per iteration "
                   "(default: no timers)")
    g.add_argument("--timing-log-option", choices=TIMING_OPTIONS, default="minmax",
                   help="the timers over the ranks: max, minmax (time/<name> the max, time/<name>/min) or all "
                   "(time/<name>/rank<r> too)")
    g.add_argument("--wandb-project", metavar="NAME", help="log to Weights & Biases under this project (needs "
                   "wandb; WANDB_MODE=offline works without a network)")
    g.add_argument("--wandb-exp-name", metavar="NAME", help="the W&B run's name (default: the run folder's name)")
    g.add_argument("--wandb-save-dir", metavar="DIR", help="W&B's local files go to DIR/wandb (default: the log dir)")
    g.add_argument("--wandb-entity", metavar="NAME", help="the W&B team or user the project belongs to")


def check_logging_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag and the fix: a missing library (``monitor.require``), a ``--wandb-*``
    flag without ``--wandb-project``, an online W&B run without an API key (``monitor.wandb_key_missing``)."""
    from tpzoo.training.monitor import require, wandb_key_missing

    if args.tensorboard_dir is not None:
        require("tensorboard", "--tensorboard-dir")
    for name in WANDB_FLAGS:
        if getattr(args, name) is not None and args.wandb_project is None:
            raise ValueError(f"--{name.replace('_', '-')} names a W&B setting but W&B is off; add --wandb-project "
                             f"NAME or drop --{name.replace('_', '-')}")
    if args.wandb_project is not None:
        require("wandb", "--wandb-project")
        if wandb_key_missing():  # else rank 0 would stop in wandb.init while the others wait in a collective
            raise ValueError("--wandb-project needs a W&B API key and none is configured: run `wandb login` (or "
                             "set WANDB_API_KEY), or log without a network with WANDB_MODE=offline")
