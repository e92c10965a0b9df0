"""fp16 loss scaling (Megatron's schedule), with one overflow decision for the whole mesh.

torch.amp.GradScaler decides overflow on each rank from the gradients that rank holds; under
tensor or pipeline parallelism those are different shards, so one rank could skip a step that
another takes and the replicas would diverge. Here the decision is all-reduced (MAX) first.

    loss * scale -> backward -> grads / scale -> any inf/nan on any rank?   (``unscale``: a device flag)
        yes: skip the step; the ``hysteresis``-th overflow since the last growth (and every one after
             it) backs off: scale = max(scale * backoff_factor, min_scale)         (``update``, once
        no:  step; after growth_interval clean steps in a row, scale *= growth_factor  the flag is read)
             and the hysteresis count starts again

That is Megatron-LM's ``DynamicGradScaler`` (``--loss-scale-window`` = growth_interval, ``--hysteresis``,
``--min-loss-scale``): a clean step does not restore the hysteresis count, only a growth does.
``static`` (Megatron's ``--loss-scale S``, its ``ConstantGradScaler``): the scale never changes, an
overflow still skips the step. The engine reads the flag in the step's one host-device sync.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.grads import any_nonfinite, local_grads

RUNNING_STATE = ("scale", "clean_steps", "hysteresis_left")  # what a resumed run takes from a checkpoint


@dataclass
class DynamicLossScaler:
    """The scale and its schedule; ``state_dict`` round-trips through a checkpoint. ``hysteresis`` 1:
    back off at every overflow (torch's GradScaler); the scripts default to Megatron's 2."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    clean_steps: int = 0
    hysteresis: int = 1
    static: bool = False
    hysteresis_left: int = field(init=False)  # overflows still tolerated before a back-off

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1):
            raise ValueError(f"loss scaler needs scale > 0, growth_factor > 1 and 0 < backoff_factor < 1; got "
                             f"scale={self.scale}, growth_factor={self.growth_factor}, "
                             f"backoff_factor={self.backoff_factor}")
        if not (0 < self.min_scale <= self.scale or self.static):
            raise ValueError(f"loss scaler needs 0 < min_scale <= scale, got min_scale={self.min_scale}, "
                             f"scale={self.scale}; lower the minimum or raise the initial scale")
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(f"loss scaler needs growth_interval >= 1 and hysteresis >= 1, got "
                             f"growth_interval={self.growth_interval}, hysteresis={self.hysteresis}")
        self.hysteresis_left = self.hysteresis

    @property
    def at_minimum(self) -> bool:
        """The scale cannot drop any further (static, or at ``min_scale``): an overflow now is the model's."""
        return self.static or self.scale <= self.min_scale

    def unscale(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Divide the gradients by the scale; return ``any_nonfinite`` over ``group`` (1: skip the step)."""
        params = list(params)  # all of them: any_nonfinite puts its flag on their device, with or without gradients
        torch._foreach_mul_(local_grads(params), 1.0 / self.scale)
        return any_nonfinite(params, group)

    def update(self, finite: bool) -> None:
        """The schedule after a step whose gradients were (not) all finite; nothing when ``static``."""
        if self.static:
            return
        if finite:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps, self.hysteresis_left = 0, self.hysteresis
        else:
            self.clean_steps = 0
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left == 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every field ``state`` holds (settings included)."""
        for key, value in state.items():
            setattr(self, key, value)

    def resume(self, state: dict[str, Any]) -> None:
        """Continue the schedule a checkpoint's ``state_dict`` left off (``RUNNING_STATE``: the scale, clean
        steps, hysteresis count; a checkpoint written before hysteresis existed holds none): the settings
        stay this scaler's (the run's flags); a static scale, saved or wanted, carries nothing over."""
        if self.static or state.get("static"):
            return
        running = {k: state[k] for k in RUNNING_STATE if k in state}
        self.load_state_dict(running)
        self.scale = max(float(self.scale), self.min_scale)
        self.hysteresis_left = min(self.hysteresis_left, self.hysteresis)


def loss_scaler(config: EngineConfig) -> DynamicLossScaler | None:
    """fp16: the loss scaler of ``config`` (static when ``loss_scale`` is set); None at fp32 and bf16."""
    if config.precision != "fp16":
        return None
    if config.loss_scale is not None:
        return DynamicLossScaler(scale=config.loss_scale, static=True)
    return DynamicLossScaler(scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                             growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)
