"""The learning-rate and weight-decay schedule: Megatron-LM's ``OptimizerParamScheduler``.

The schedule is a function of n, the steps counted so far; pretrain.py counts samples: the lr of an
iteration is the schedule at the samples consumed BEFORE it (iteration 1: n = 0), so

    n <= W (W > 0):   init + (lr - init) n / W                         (init = --lr-warmup-init)
    constant:         lr
    n > D:            min_lr                                           (D = decay steps)
    inverse-square-root: max(min_lr, lr sqrt(max(W, 1)) / sqrt(max(n, 1)))
    otherwise:        min_lr + (lr - min_lr) f(r),  r = (n - W) / (D - W)
                      f = 1 - r (linear), (1 + cos(pi r)) / 2 (cosine),
                      WSD: 1 until D - A, then with q = (n - (D - A)) / A (A = WSD decay steps):
                      1 - q (linear), (1 + cos(pi q)) / 2 (cosine), 2 * 0.5^q - 1 (exponential), 1 - sqrt(q)
    weight decay:     end_wd for n > I (I = increment steps); else start_wd + (end_wd - start_wd) c,
                      c = n / I (linear), (1 + cos(pi (1 - n / I))) / 2 (cosine); constant: weight decay

In samples (``tpzoo.training.optimizer_args.TrainingConfig.lr_schedule``), Megatron-LM's
``get_optimizer_param_scheduler``: with --train-iters T and the final global batch G, D = --lr-decay-iters
(default T) x G, W = --lr-warmup-iters x G, A = --lr-wsd-decay-iters x G, I = T x G; with --train-samples,
D = --lr-decay-samples (default --train-samples), W = --lr-warmup-samples, A = --lr-wsd-decay-samples,
I = --train-samples; with --lr-warmup-fraction, W = fraction x D. finetune.py counts optimizer steps instead
(its iteration).

The schedule is a pure function of n, so resuming needs only the consumed samples; its settings
travel in the checkpoint's meta (``state_dict``) so that a resumed run can say when the flags changed them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: float
    style: str = "cosine"
    init_lr: float = 0.0
    wsd_decay_steps: float | None = None
    wsd_style: str = "exponential"
    start_wd: float | None = None  # None: the optimizer's weight decay is left as it is
    end_wd: float | None = None
    wd_incr_steps: float = 0
    wd_style: str = "constant"

    def __post_init__(self) -> None:
        for value, styles, flag in ((self.style, STYLES, "--lr-decay-style"),
                                    (self.wsd_style, WSD_STYLES, "--lr-wsd-decay-style"),
                                    (self.wd_style, WD_STYLES, "--weight-decay-incr-style")):
            if value not in styles:
                raise ValueError(f"{flag} {value!r} is not one of {', '.join(styles)}")
        if not self.lr > 0:
            raise ValueError(f"--lr {self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr {self.min_lr} must lie in [0, --lr {self.lr}]")
        if not 0 <= self.init_lr <= self.lr:
            raise ValueError(f"--lr-warmup-init {self.init_lr} must lie in [0, --lr {self.lr}]")
        if self.style == "WSD" and not self.wsd_decay_steps:
            raise ValueError("--lr-decay-style WSD needs the length of its decay: --lr-wsd-decay-iters or "
                             "--lr-wsd-decay-samples")
        if self.start_wd is not None and not 0 <= self.start_wd <= self.end_wd:
            raise ValueError(f"--start-weight-decay {self.start_wd} must lie in [0, --end-weight-decay {self.end_wd}]")

    def lr_at(self, n: float) -> float:
        """The learning rate after ``n`` steps (pretrain.py: samples consumed before the iteration)."""
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + (self.lr - self.init_lr) * n / self.warmup_steps
        if self.style == "constant":
            return self.lr
        if n > self.decay_steps:
            return self.min_lr
        if self.style == "inverse-square-root":
            return max(self.min_lr, self.lr * math.sqrt(max(self.warmup_steps, 1)) / math.sqrt(max(n, 1)))
        ratio = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable, then the anneal of its last wsd_decay_steps
            anneal = self.decay_steps - self.wsd_decay_steps
            q = max(0.0, (n - anneal) / self.wsd_decay_steps)
            coeff = {"linear": 1.0 - q, "cosine": 0.5 * (math.cos(math.pi * q) + 1.0),
                     "exponential": 2.0 * 0.5**q - 1.0, "minus_sqrt": 1.0 - math.sqrt(q)}[self.wsd_style]
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def wd_at(self, n: float) -> float | None:
        """The weight decay after ``n`` steps (None: not scheduled)."""
        if self.start_wd is None:
            return None
        if n > self.wd_incr_steps or self.wd_style == "constant":
            return self.end_wd
        ratio = n / self.wd_incr_steps
        coeff = ratio if self.wd_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def apply(self, optimizer: torch.optim.Optimizer, n: float) -> float:
        """Set every param group's lr (and scheduled weight decay) to their values after ``n`` steps;
        returns the lr (ZeRO-1 copies it to its shard on step)."""
        lr, wd = self.lr_at(n), self.wd_at(n)
        for group in optimizer.param_groups:
            group["lr"] = lr
            if wd is not None:
                group["weight_decay"] = wd
        return lr

    def warmup_outlasts_decay(self) -> str | None:
        """What to say when the warmup does not end before the decay does (Megatron-LM asserts it does; tpzoo
        runs it, e.g. a family's default warmup in a short run): the lr never reaches --lr. None otherwise."""
        if self.style == "constant" or self.warmup_steps < self.decay_steps:
            return None
        return (f"the lr warmup ({self.warmup_steps:g} samples) does not end before the decay does "
                f"({self.decay_steps:g} samples): the lr never reaches --lr {self.lr:g}; shorten the warmup "
                f"(--lr-warmup-iters, --lr-warmup-fraction) or lengthen the run")

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def changes_from(self, saved: dict[str, Any], global_batch_size: int = 1) -> list[str]:
        """``name: saved -> now`` for every setting that differs from a checkpoint's ``state_dict``. A checkpoint of
        tpzoo's earlier schedule (``warmup_iters``, ``decay_iters``: iterations) is read in samples of
        ``global_batch_size`` (``earlier_format``)."""
        if earlier_format(saved):
            saved = dict(saved, warmup_steps=saved["warmup_iters"] * global_batch_size,
                         decay_steps=saved["decay_iters"] * global_batch_size)
        return [f"{k}: {saved.get(k, v)} -> {v}" for k, v in self.state_dict().items() if saved.get(k, v) != v]


def earlier_format(saved: dict[str, Any]) -> bool:
    """Whether a checkpoint's schedule state is tpzoo's earlier one, which set the lr of iteration i at step i
    (iterations, not the samples before it): its run goes on at n = consumed samples + G (``Run.lr_steps``),
    the lr it would have had."""
    return "warmup_iters" in saved
