"""The batch, schedule and optimizer flags (Megatron-LM's names and meanings): ``add_optimizer_args``,
and what the flags make of the run's length.

    --train-iters T | --train-samples N          the run's length (exclusive; N: ``BatchSchedule.iterations``)
    --global-batch-size G, --rampup-batch-size START INCR SAMPLES | --step-batch-size-schedule "0:16 2.4B:320"
    --lr --min-lr --lr-warmup-init --lr-decay-style --lr-warmup-iters | --lr-warmup-samples | --lr-warmup-fraction
    --lr-decay-iters | --lr-decay-samples, WSD: --lr-wsd-decay-style --lr-wsd-decay-iters | --lr-wsd-decay-samples
    --optimizer adam|sgd --adam-beta1 --adam-beta2 --adam-eps --sgd-momentum --weight-decay
    --weight-decay-incr-style --start-weight-decay --end-weight-decay --clip-grad --init-method-std --seed

The schedules' formulas: ``tpzoo.training.lr_schedule`` and ``tpzoo.training.batch_schedule``.
This module imports without torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from typing import Any

from tpzoo.flag_types import non_negative_float, non_negative_int, positive_float, positive_int, probability
from tpzoo.models.families import FAMILIES, family
from tpzoo.training.args import config_flag, fill_model_defaults
from tpzoo.training.batch_schedule import BatchSchedule
from tpzoo.training.lr_schedule import STYLES, WD_STYLES, WSD_STYLES

# a family's iteration-counted defaults (tpzoo.models.families train_defaults) that do not apply once the
# run is counted in samples, or its warmup set another way
ITERATION_DEFAULTS = {"train_samples": ("train_iters", "lr_warmup_iters"), "lr_warmup_samples": ("lr_warmup_iters",),
                      "lr_warmup_fraction": ("lr_warmup_iters",)}
MEGATRON_DEFAULTS = {"train_iters": None, "lr_warmup_iters": 0}  # what they are then

# a resume that is given the first flag does not restore the others from the checkpoint (the run's length
# counted in the other unit, the warmup or the batch ramp set another way)
_SAMPLES = {"train_samples", "lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"}
_ITERS = {"train_iters", "lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters"}
SCHEDULE_GIVEN_TOGETHER = {**{name: _SAMPLES for name in _ITERS}, **{name: _ITERS for name in _SAMPLES},
                           "lr_warmup_iters": _SAMPLES | {"lr_warmup_fraction"},
                           "lr_warmup_samples": _ITERS | {"lr_warmup_fraction"},
                           "lr_warmup_fraction": {"lr_warmup_iters", "lr_warmup_samples"},
                           "rampup_batch_size": {"step_batch_size_schedule"},
                           "step_batch_size_schedule": {"rampup_batch_size"},
                           "weight_decay_incr_style": {"start_weight_decay", "end_weight_decay"}}


def add_optimizer_args(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Batch sizes, run length, optimizer and learning-rate schedule; ``defaults`` override the values
    below (``train_iters=None`` leaves the run-length flags out: finetune.py counts epochs)."""
    d = {**dict(micro_batch_size=4, global_batch_size=16, train_iters=100, lr=1e-3, min_lr=0.0, lr_warmup_iters=0,
                lr_decay_style="cosine", weight_decay=0.01, clip_grad=1.0, seed=1234), **defaults}
    g = parser.add_argument_group("batch and optimizer")
    g.add_argument("--micro-batch-size", type=positive_int, default=d["micro_batch_size"])
    g.add_argument("--global-batch-size", type=positive_int, default=d["global_batch_size"],
                   help="sequences per optimizer step (after any ramp-up)")
    iterations = d["train_iters"] is not None
    if iterations:
        g.add_argument("--train-iters", type=non_negative_int, default=d["train_iters"],
                       help="0 with --save: save the untrained model (a control run)")
        g.add_argument("--train-samples", type=positive_int, help="the run's length in samples instead of "
                       "--train-iters: the iterations it takes, the batch ramp-up counted")
        g.add_argument("--rampup-batch-size", type=non_negative_int, nargs=3, metavar=("START", "INCR", "SAMPLES"),
                       help="grow the global batch from START by INCR over SAMPLES samples to --global-batch-size")
        g.add_argument("--step-batch-size-schedule", nargs="+", metavar="T:B",
                       help="global batch B from T tokens consumed on (suffixes K M B T); the last B is the "
                       "global batch size (--global-batch-size: left out, or the same); one word or several "
                       "(Megatron-LM's GPT-3 script passes its quoted schedule through an unquoted ${ARGS[@]}: "
                       "several)")
    g.add_argument("--lr", type=positive_float, default=d["lr"])
    g.add_argument("--min-lr", type=non_negative_float, default=d["min_lr"])
    g.add_argument("--lr-warmup-init", type=non_negative_float, default=0.0, help="the lr warmup starts from")
    g.add_argument("--lr-warmup-iters", type=non_negative_int, default=d["lr_warmup_iters"],
                   help="the warmup in iterations")
    g.add_argument("--lr-decay-style", choices=STYLES if iterations else STYLES[:-1], default=d["lr_decay_style"],
                   help="WSD: with --lr-wsd-decay-iters/-samples" if iterations else None)
    if iterations:
        g.add_argument("--lr-warmup-samples", type=non_negative_int, default=0,
                       help="the warmup in samples, with --train-samples (default: 0)")
        g.add_argument("--lr-warmup-fraction", type=probability, help="warmup = this fraction of the decay")
        g.add_argument("--lr-decay-iters", type=positive_int, help="default: --train-iters")
        g.add_argument("--lr-decay-samples", type=positive_int, help="default: --train-samples")
        g.add_argument("--lr-wsd-decay-style", choices=WSD_STYLES, default="exponential",
                       help="WSD: the anneal's shape")
        g.add_argument("--lr-wsd-decay-iters", type=positive_int, help="WSD: the anneal's length")
        g.add_argument("--lr-wsd-decay-samples", type=positive_int, help="WSD: the anneal's length")
        g.add_argument("--weight-decay-incr-style", choices=WD_STYLES, default="constant")
        g.add_argument("--start-weight-decay", type=non_negative_float, help="linear/cosine weight decay: from")
        g.add_argument("--end-weight-decay", type=non_negative_float, help="linear/cosine weight decay: to")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="adam: AdamW (decoupled weight decay); sgd: with momentum, L2 weight decay")
    g.add_argument("--adam-beta1", type=probability, default=0.9)
    g.add_argument("--adam-beta2", type=probability, default=0.999)
    g.add_argument("--adam-eps", type=positive_float, default=1e-8)
    g.add_argument("--sgd-momentum", type=non_negative_float, default=0.9)
    g.add_argument("--weight-decay", type=non_negative_float, default=d["weight_decay"])
    g.add_argument("--clip-grad", type=non_negative_float, default=d["clip_grad"], help="global gradient norm; 0 = off")
    config_flag(g, "init_method_std", help="default: the model's")
    g.add_argument("--seed", type=non_negative_int, default=d["seed"])


class TrainDefaults(Mapping):
    """Each registered family's ``train_defaults``, by any name ``--model`` takes (pretrain.py's per-model
    schedule defaults); iterates over the registered families."""

    def __getitem__(self, model: str) -> dict[str, Any]:
        return family(model).train_defaults

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)


def fill_schedule_defaults(args: argparse.Namespace, defaults: Mapping[str, dict[str, Any]]) -> argparse.Namespace:
    """``fill_model_defaults``, but the family's iteration-counted defaults that the flags replace are
    Megatron-LM's (--train-samples: no --train-iters, --lr-warmup-iters 0; --lr-warmup-samples/-fraction:
    --lr-warmup-iters 0)."""
    dropped = {name for flag, names in ITERATION_DEFAULTS.items() if getattr(args, flag, None) for name in names}
    values = {k: MEGATRON_DEFAULTS[k] if k in dropped else v for k, v in defaults[args.model].items()}
    return fill_model_defaults(args, {args.model: values})


def check_optimizer_resume(args: argparse.Namespace, saved_args: dict[str, Any]) -> None:
    """ValueError when the resumed run's --optimizer differs from the checkpoint's (``saved_args``; before the
    flag: adam) and its optimizer state would be loaded: AdamW's moments are no SGD momentum."""
    before = saved_args.get("optimizer", "adam")
    if before != args.optimizer and not (getattr(args, "finetune", False) or getattr(args, "no_load_optim", False)):
        raise ValueError(f"--optimizer {args.optimizer} cannot take over the {before} state of --load {args.load}; "
                         f"add --no-load-optim (the optimizer state starts afresh) or resume with --optimizer {before}")


def train_iterations(args: argparse.Namespace, batches: BatchSchedule) -> int:
    """The iterations the run makes: --train-iters, or those --train-samples takes (``BatchSchedule.iterations``)."""
    return args.train_iters if args.train_iters is not None else batches.iterations(args.train_samples)
