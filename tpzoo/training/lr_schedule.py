"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay to ``min_lr``.

Iterations count from 1 (the step that makes iteration ``i`` uses ``lr_at(i)``), as Megatron-LM's:

    i <= W:       lr * i / W                                     (W = warmup_iters)
    i >  W:       min_lr + (lr - min_lr) * f((i - W) / (D - W))  (D = decay_iters, usually --train-iters)
                  f = 1 (constant), 1 - r (linear), (1 + cos(pi r)) / 2 (cosine); r = 1 from D on

The schedule is a pure function of the iteration, so resuming needs only the iteration; its
settings travel in the checkpoint's meta (``state_dict``) so that a resumed run can say when the
flags changed them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str = "cosine"

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"--lr-decay-style {self.style!r} is not one of {', '.join(STYLES)}")
        if not self.lr > 0:
            raise ValueError(f"--lr {self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr {self.min_lr} must lie in [0, --lr {self.lr}]")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LRSchedule:
        """The schedule of ``--lr --min-lr --lr-warmup-iters --lr-decay-style``, decaying over ``--train-iters``."""
        return cls(args.lr, args.min_lr, args.lr_warmup_iters, args.train_iters, args.lr_decay_style)

    def lr_at(self, iteration: int) -> float:
        """The learning rate of the step that makes ``iteration`` (1-based)."""
        if iteration <= self.warmup_iters:
            return self.lr * iteration / self.warmup_iters
        if self.style == "constant":
            return self.lr
        ratio = 1.0 if iteration >= self.decay_iters else (
            (iteration - self.warmup_iters) / (self.decay_iters - self.warmup_iters))
        factor = 1.0 - ratio if self.style == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
        return self.min_lr + (self.lr - self.min_lr) * factor

    def apply(self, optimizer: torch.optim.Optimizer, iteration: int) -> float:
        """Set every param group's lr to ``lr_at(iteration)`` (ZeRO-1 copies it to its shard on step)."""
        lr = self.lr_at(iteration)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def changes_from(self, saved: dict[str, Any]) -> list[str]:
        """``name: saved -> now`` for every setting that differs from a checkpoint's ``state_dict``."""
        return [f"{k}: {saved.get(k)} -> {v}" for k, v in self.state_dict().items() if saved.get(k) != v]
