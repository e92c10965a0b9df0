"""Dynamic loss scaling for fp16 training, with one overflow decision for the whole mesh.

torch.amp.GradScaler decides overflow on each rank from the gradients that rank holds; under
tensor or pipeline parallelism those are different shards, so one rank could skip a step that
another takes and the replicas would diverge. Here the decision is all-reduced (MAX) first.

    loss * scale -> backward -> grads / scale -> any inf/nan on any rank?   (``unscale``: a device flag)
        yes: skip the step, scale *= backoff_factor (never below min_scale)   (``update``, once the
        no:  step; after growth_interval clean steps in a row, scale *= growth_factor    flag is read)

The engine reads the flag in the step's one host-device sync, with the loss and the gradient norm.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from tpzoo.engine.grads import any_nonfinite


@dataclass
class DynamicLossScaler:
    """The scale and its schedule; ``state_dict`` round-trips through a checkpoint."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    clean_steps: int = 0

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1):
            raise ValueError(f"loss scaler needs scale > 0, growth_factor > 1 and 0 < backoff_factor < 1; got "
                             f"scale={self.scale}, growth_factor={self.growth_factor}, "
                             f"backoff_factor={self.backoff_factor}")

    def unscale(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Divide the gradients by the scale; return ``any_nonfinite`` over ``group`` (1: skip the step)."""
        params = [p for p in params if p.grad is not None]
        torch._foreach_mul_([p.grad for p in params], 1.0 / self.scale)
        return any_nonfinite(params, group)

    def update(self, finite: bool) -> None:
        """The schedule after a step whose gradients were (not) all finite."""
        if finite:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0
        else:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
