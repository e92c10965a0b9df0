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
from dataclasses import dataclass
from typing import Any

from tpzoo.fields import (add_section, at_least, check_fields, fraction, non_negative_number, one_of, option, optional,
                          parses, positive_number, seed)
from tpzoo.flag_types import non_negative_int
from tpzoo.models.config import ModelConfig
from tpzoo.models.families import FAMILIES, family
from tpzoo.training.batch_schedule import BatchSchedule, parse_step_schedule
from tpzoo.training.lr_schedule import STYLES, WD_STYLES, WSD_STYLES, LRSchedule

# a family's iteration-counted defaults (tpzoo.models.families train_defaults) that do not apply once the
# run is counted in samples, or its warmup set another way
ITERATION_DEFAULTS = {"train_samples": ("train_iters", "lr_warmup_iters"), "lr_warmup_samples": ("lr_warmup_iters",),
                      "lr_warmup_fraction": ("lr_warmup_iters",)}
MEGATRON_DEFAULTS = {"train_iters": None, "lr_warmup_iters": 0}  # what they are then
# a resume that is given one of these does not restore the others from the checkpoint (the run's length
# counted in the other unit, the warmup or the batch ramp set another way)
_SAMPLES = ("train_samples", "lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples")
_ITERS = ("train_iters", "lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters")


@parses(non_negative_int)
def _ramp(v: Any) -> str | None:
    ok = isinstance(v, (list, tuple)) and len(v) == 3 and all(type(x) is int and x >= 0 for x in v)
    return None if ok else f"must be 3 integers >= 0 (START INCR SAMPLES), got {v!r}"


@parses(str)
def _words(v: Any) -> str | None:
    ok = isinstance(v, str) or isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v)
    return None if ok else f"must be THRESHOLD:BATCH words (a string or a list of them), got {v!r}"


def _length(default: Any, check: Any, doc: str, flag: str, *, unit: tuple[str, ...], **role: Any) -> Any:
    """A field counted in iterations or in samples: given on a resume, the other unit's are not restored."""
    return option(default, check, doc, flag, together=unit, **role)


_INIT_STD = ModelConfig.__dataclass_fields__["init_method_std"].metadata


@dataclass(frozen=True)
class TrainingConfig:
    """Batch sizes, the run's length, the optimizer and the learning-rate and weight-decay schedules (Megatron-LM's
    names and meanings; the formulas: ``tpzoo.training.lr_schedule`` and ``tpzoo.training.batch_schedule``).
    ``ITERATION_FIELDS`` are pretrain.py's only (finetune.py counts epochs; its loop saves its best checkpoint at any
    evaluation, which local SGD's replicas would not agree on)."""

    micro_batch_size: int = option(4, at_least(1), "", "--micro-batch-size")
    global_batch_size: int = option(16, at_least(1), "sequences per optimizer step (after any ramp-up)",
                                    "--global-batch-size")
    train_iters: int | None = _length(100, optional(at_least(0)), "0 with --save: save the untrained model (a control "
                                      "run)", "--train-iters", unit=_SAMPLES)
    train_samples: int | None = _length(None, optional(at_least(1)), "the run's length in samples instead of "
                                        "--train-iters: the iterations it takes, the batch ramp-up counted",
                                        "--train-samples", unit=_ITERS)
    rampup_batch_size: tuple[int, int, int] | None = option(
        None, optional(_ramp), "grow the global batch from START by INCR over SAMPLES samples to --global-batch-size",
        "--rampup-batch-size", ("START", "INCR", "SAMPLES"), nargs=3, together=("step_batch_size_schedule",))
    step_batch_size_schedule: list[str] | None = option(
        None, optional(_words), "global batch B from T tokens consumed on (suffixes K M B T); the last B is the "
        "global batch size (--global-batch-size: left out, or the same); one word or several (Megatron-LM's GPT-3 "
        "script passes its quoted schedule through an unquoted ${ARGS[@]}: several)", "--step-batch-size-schedule",
        "T:B", nargs="+", together=("rampup_batch_size",))
    lr: float = option(1e-3, positive_number, "", "--lr")
    min_lr: float = option(0.0, non_negative_number, "", "--min-lr")
    lr_warmup_init: float = option(0.0, non_negative_number, "the lr warmup starts from", "--lr-warmup-init")
    lr_warmup_iters: int = _length(0, at_least(0), "the warmup in iterations", "--lr-warmup-iters",
                                   unit=(*_SAMPLES, "lr_warmup_fraction"))
    lr_decay_style: str = option("cosine", one_of(*STYLES), "WSD: with --lr-wsd-decay-iters/-samples",
                                 "--lr-decay-style")
    lr_warmup_samples: int = _length(0, at_least(0), "the warmup in samples, with --train-samples (default: 0)",
                                     "--lr-warmup-samples", unit=(*_ITERS, "lr_warmup_fraction"))
    lr_warmup_fraction: float | None = option(None, optional(fraction), "warmup = this fraction of the decay",
                                              "--lr-warmup-fraction", together=("lr_warmup_iters", "lr_warmup_samples"))
    lr_decay_iters: int | None = _length(None, optional(at_least(1)), "default: --train-iters", "--lr-decay-iters",
                                         unit=_SAMPLES)
    lr_decay_samples: int | None = _length(None, optional(at_least(1)), "default: --train-samples",
                                           "--lr-decay-samples", unit=_ITERS)
    lr_wsd_decay_style: str = option("exponential", one_of(*WSD_STYLES), "WSD: the anneal's shape",
                                     "--lr-wsd-decay-style")
    lr_wsd_decay_iters: int | None = _length(None, optional(at_least(1)), "WSD: the anneal's length",
                                             "--lr-wsd-decay-iters", unit=_SAMPLES)
    lr_wsd_decay_samples: int | None = _length(None, optional(at_least(1)), "WSD: the anneal's length",
                                               "--lr-wsd-decay-samples", unit=_ITERS)
    weight_decay_incr_style: str = option("constant", one_of(*WD_STYLES), "", "--weight-decay-incr-style",
                                          together=("start_weight_decay", "end_weight_decay"))
    start_weight_decay: float | None = option(None, optional(non_negative_number), "linear/cosine weight decay: from",
                                              "--start-weight-decay")
    end_weight_decay: float | None = option(None, optional(non_negative_number), "linear/cosine weight decay: to",
                                            "--end-weight-decay")
    optimizer: str = option("adam", one_of("adam", "sgd"), "adam: AdamW (decoupled weight decay); sgd: with "
                            "momentum, L2 weight decay", "--optimizer")
    adam_beta1: float = option(0.9, fraction, "", "--adam-beta1")
    adam_beta2: float = option(0.999, fraction, "", "--adam-beta2")
    adam_eps: float = option(1e-8, positive_number, "", "--adam-eps")
    sgd_momentum: float = option(0.9, non_negative_number, "", "--sgd-momentum")
    weight_decay: float = option(0.01, non_negative_number, "", "--weight-decay")
    clip_grad: float = option(1.0, non_negative_number, "global gradient norm; 0 = off", "--clip-grad")
    init_method_std: float | None = option(None, optional(_INIT_STD["check"]), f"{_INIT_STD['doc']} (default: the "
                                           f"model's)", "--init-method-std")
    seed: int = option(1234, seed, "", "--seed", meaning=True)
    local_sgd_steps: int | None = option(None, optional(at_least(1)), "local SGD over dp: each replica takes H steps "
                                         "on its own gradients, then the replicas average their moves (one "
                                         "all-reduce of the weights every H steps; docs/elastic.md)",
                                         "--local-sgd-steps", "H")
    outer_lr: float = option(1.0, positive_number, "with --local-sgd-steps: the outer step's learning rate (1: the "
                             "replicas' mean)", "--outer-lr")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.rampup_batch_size is not None and self.step_batch_size_schedule is not None:
            raise ValueError("--rampup-batch-size and --step-batch-size-schedule both set the batch size ramp; "
                             "give one of them")

    def batches(self, seq_length: int) -> BatchSchedule:
        """--global-batch-size with --rampup-batch-size or --step-batch-size-schedule (tokens / ``seq_length``)."""
        rampup, steps = self.rampup_batch_size, self.step_batch_size_schedule
        return BatchSchedule(self.global_batch_size, tuple(rampup) if rampup is not None else None,
                             parse_step_schedule(steps, seq_length) if steps is not None else None)

    def lr_schedule(self, batches: BatchSchedule) -> LRSchedule:
        """The lr and weight-decay schedule, in samples (``tpzoo.training.lr_schedule``'s docstring: its steps D, W, A
        and I from these flags). ValueError for the flag pairs Megatron-LM refuses."""
        check_schedule_flags(self)
        g = batches.global_batch_size
        if self.train_iters is not None:
            decay = (self.lr_decay_iters or self.train_iters) * g
            warmup = (self.lr_warmup_iters or 0) * g
            wsd = self.lr_wsd_decay_iters * g if self.lr_wsd_decay_iters is not None else None
            incr = self.train_iters * g
        else:
            decay = self.lr_decay_samples or self.train_samples
            warmup, wsd, incr = self.lr_warmup_samples, self.lr_wsd_decay_samples, self.train_samples
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        start, end = weight_decay_range(self)
        return LRSchedule(self.lr, self.min_lr, warmup, decay, self.lr_decay_style, self.lr_warmup_init, wsd,
                          self.lr_wsd_decay_style, start, end, incr, self.weight_decay_incr_style)

    def iterations(self, batches: BatchSchedule) -> int:
        """The iterations the run makes: --train-iters, or those --train-samples takes
        (``BatchSchedule.iterations``)."""
        return self.train_iters if self.train_iters is not None else batches.iterations(self.train_samples)


ITERATION_FIELDS = ("train_iters", "train_samples", "rampup_batch_size", "step_batch_size_schedule",
                    "lr_warmup_samples", "lr_warmup_fraction", "lr_decay_iters", "lr_decay_samples",
                    "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples", "weight_decay_incr_style",
                    "start_weight_decay", "end_weight_decay", "local_sgd_steps", "outer_lr")


def add_optimizer_args(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Batch sizes, run length, optimizer and learning-rate schedule (``TrainingConfig``); ``defaults`` override its
    defaults (``train_iters=None`` leaves ``ITERATION_FIELDS`` out and WSD, which needs them: finetune.py counts
    epochs)."""
    iterations = defaults.get("train_iters", 0) is not None
    add_section(parser, TrainingConfig, "batch and optimizer", () if iterations else ITERATION_FIELDS,
                        **defaults)
    if not iterations:
        style = parser._option_string_actions["--lr-decay-style"]
        style.choices, style.help = STYLES[:-1], None


def set_model_defaults(parser: argparse.ArgumentParser, defaults: Mapping[str, dict[str, Any]]) -> None:
    """Make the flags of ``defaults`` (per ``--model``: {dest: value}) None until given, their help
    naming each model's value; ``fill_model_defaults`` fills them in once the model is known."""
    names = set().union(*defaults.values())
    for action in parser._actions:
        if action.dest in names:
            action.default = None
            by_model = ", ".join(f"{model} {values[action.dest]:g}" for model, values in defaults.items())
            action.help = "; ".join(filter(None, [action.help, f"default: {by_model}"]))


def fill_model_defaults(args: argparse.Namespace, defaults: Mapping[str, dict[str, Any]]) -> argparse.Namespace:
    """Set each flag of ``defaults[args.model]`` that is None (not given) to the model's default."""
    unknown = sorted(set(defaults[args.model]) - set(vars(args)))
    if unknown:
        raise ValueError(f"the train_defaults of model {args.model!r} name {', '.join(unknown)}, which are no flags "
                         f"of this command; use the flags' destinations (e.g. train_iters, lr, min_lr)")
    for name, value in defaults[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


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


def resolve_global_batch_size(args: argparse.Namespace, given: set[str] | None = None) -> None:
    """With --step-batch-size-schedule and no --global-batch-size in ``given`` (the flags written on the
    command line; None: all of them), set ``args.global_batch_size`` to the schedule's last batch size
    (Megatron-LM takes G from the schedule); when both are given, ``BatchSchedule`` checks that they agree."""
    text = getattr(args, "step_batch_size_schedule", None)
    if text is not None and given is not None and "global_batch_size" not in given:
        steps = parse_step_schedule(text, args.seq_length)
        if steps:
            args.global_batch_size = steps[-1][1]


def check_schedule_flags(training: TrainingConfig) -> None:
    """ValueError naming the pair, for the flags Megatron-LM's arguments.py refuses together: --train-iters
    with --train-samples, an *-iters flag in a run counted in samples (or *-samples in one counted in
    iterations), --lr-warmup-fraction with --lr-warmup-iters/-samples."""
    if training.train_iters is not None and training.train_samples is not None:
        raise ValueError("--train-iters and --train-samples both set the run's length; give one of them")
    if training.train_iters is None and training.train_samples is None:
        raise ValueError("give --train-iters or --train-samples (the run's length)")
    unit, other = ("samples", "iters") if training.train_iters is None else ("iters", "samples")
    for name in (f"lr_decay_{other}", f"lr_wsd_decay_{other}", f"lr_warmup_{other}"):
        if getattr(training, name):
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} counts {other}, but the run's length is --train-{unit}; give "
                             f"{flag.replace(other, unit)} instead")
    if training.lr_warmup_fraction is not None and getattr(training, f"lr_warmup_{unit}"):
        raise ValueError(f"--lr-warmup-fraction and --lr-warmup-{unit} both set the warmup; give one of them")


def weight_decay_range(training: TrainingConfig) -> tuple[float | None, float | None]:
    """(start, end) weight decay of --weight-decay-incr-style (Megatron-LM's rules): constant takes neither
    --start-weight-decay nor --end-weight-decay (None, None: --weight-decay throughout); linear and cosine
    need both."""
    start, end = training.start_weight_decay, training.end_weight_decay
    if training.weight_decay_incr_style == "constant":
        if start is not None or end is not None:
            raise ValueError("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or "
                             "cosine; with constant, give --weight-decay")
        return None, None
    if start is None or end is None:
        raise ValueError(f"--weight-decay-incr-style {training.weight_decay_incr_style} needs both "
                         f"--start-weight-decay and --end-weight-decay")
    return start, end
