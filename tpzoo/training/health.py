"""Which checkpoint of a run trains on, and steps that learn nothing.

    health = Health(pending=loaded_from, reference=saved_reference)  # per run; the same on every rank
    line = health.step(iteration, result.loss, result.grad_norm)     # after each step: a line to print, or None
    health.saved(path)                                                # after each save

The weights a checkpoint holds are judged by the step after it, whose loss they give (step i's loss is
computed before step i's update): a saved checkpoint is *pending* until that step, then *confirmed* when the
step is healthy and dropped when it is not (``refuted`` says why). A step is healthy when its loss is finite
and at most ``LOSS_FACTOR`` times the run's reference loss (its first finite one, kept in each checkpoint's
meta so that a resumed run judges by the same), and its gradient norm, where finite, at most ``GRAD_FACTOR``
times the median of the run's last ``NORM_WINDOW`` healthy ones. A skipped step (fp16 overflow) changes no
weight and judges the same checkpoint again. A loaded checkpoint starts pending: its first step judges it.
``zero_steps``: steps in a row whose gradients were all zero (gradient norm 0, as when an fp16 loss scale
underflows every gradient); the first of each such streak is named.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

LOSS_FACTOR = 2.0     # a fresh model's loss is about ln(vocabulary); a loss twice the run's first has blown up
GRAD_FACTOR = 100.0   # gradient norms shrink as training settles; a hundredfold jump over their median has blown up
NORM_WINDOW = 100


@dataclass
class Health:
    pending: str | None = None     # the last checkpoint saved (or loaded) that no step has judged yet
    reference: float | None = None  # the run's first finite loss
    confirmed: str | None = None   # the last checkpoint whose next step was healthy
    refuted: str | None = None     # why the last dropped checkpoint was dropped
    zero_steps: int = 0            # steps in a row with every gradient zero
    norms: deque = field(default_factory=lambda: deque(maxlen=NORM_WINDOW))

    def saved(self, path: str) -> None:
        self.pending = path

    def problem(self, loss: float, grad_norm: float) -> str | None:
        """What makes a step with this loss and gradient norm unhealthy, or None."""
        if not math.isfinite(loss):
            return "a non-finite loss"
        if self.reference is not None and loss > LOSS_FACTOR * self.reference:
            return f"loss {loss:.4g}, over {LOSS_FACTOR:g}x the run's first {self.reference:.4g}"
        if math.isfinite(grad_norm) and len(self.norms) >= 3 and grad_norm > GRAD_FACTOR * statistics.median(
                self.norms):
            return f"gradient norm {grad_norm:.4g}, over {GRAD_FACTOR:g}x the median of the run's last ones"
        return None

    def step(self, iteration: int, loss: float, grad_norm: float) -> str | None:
        """Judge the pending checkpoint by this step; the line to print at the first step of a streak whose
        gradients are all zero, else None."""
        zero = grad_norm == 0.0
        self.zero_steps = self.zero_steps + 1 if zero else 0
        problem = self.problem(loss, grad_norm)
        if problem is None:
            self.reference = loss if self.reference is None else self.reference
            if math.isfinite(grad_norm) and not zero:
                self.norms.append(grad_norm)
            if self.pending is not None:
                self.confirmed, self.pending, self.refuted = self.pending, None, None
        elif self.pending is not None:
            self.refuted, self.pending = f"{self.pending} gave {problem} at iteration {iteration}", None
        if zero and self.zero_steps == 1:
            return f"iteration {iteration}: every gradient is zero (gradient norm 0); the step changes no weight"
        return None

    def advice(self, start: str) -> str:
        """Which checkpoint to resume from, for a stop line: the last confirmed one (and why a later one is
        not), else that none trains on (``start``: what to do then)."""
        why = f" ({self.refuted})" if self.refuted else ""
        if self.confirmed is not None:
            return f"the last checkpoint that trains on is {self.confirmed}{why}; resume from it"
        return f"no checkpoint of this run trains on{why}; {start}" if why else f"no checkpoint was saved; {start}"
