"""When a training loop stops early (Megatron-LM's exit flags), and a diverged run's stop.

    with StopRules.of(stopping, device) as rules:   # a StoppingConfig; installs the SIGTERM/SIGINT handler
        while ...:
            result = engine.train_step(batch)
            health.step(iteration, result.loss, result.grad_norm)                   # tpzoo.training.health
            check_divergence(engine, stopping.max_skipped_steps, iteration, health)   # Diverged: exit 1
            reason = rules.reason(iteration)        # collective: the same on every rank
            if reason: save, print one line, return  # exit 0
    # the previous handlers are back

``--exit-signal-handler`` (on by default): SIGTERM or SIGINT only sets a flag; the loop finishes
its step, and after it every rank agrees (one MAX all-reduce over the world group of [signal
number, duration exceeded]), so a rank that received the signal a step later than another (or not at
all) stops at the same iteration. Under torchrun the agent forwards the signal to every worker and
kills them after its ``--shutdown-timeout`` (30 s unless given): the save must fit in it. A second
SIGINT at least ``SIGINT_GRACE_S`` after the first raises KeyboardInterrupt (Ctrl-C twice kills the
run); one sooner is the duplicate torchrun forwards of the terminal's Ctrl-C, and is ignored, as
are repeated SIGTERMs. ``--exit-interval N``: stop after each iteration divisible by N.
``--exit-duration-in-mins M``: stop once M minutes of wall time have passed since the loop started
(rank 0's clock, agreed). ``check_divergence``: ``--max-skipped-steps`` skipped steps in a row
(``engine.bad_steps``), or as many whose gradients were all zero, end the run with one line on stderr
naming the checkpoint that trains on (``tpzoo.training.health``) and exit status 1 (``Diverged``).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from tpzoo.parallel.health import peers_named
from tpzoo.training.health import Health
from tpzoo.training.run_config import StoppingConfig

SIGNALS = (signal.SIGTERM, signal.SIGINT)
SIGINT_GRACE_S = 2.0  # a second SIGINT sooner than this is torchrun forwarding the first one


class SignalFlag:
    """While entered (main thread only): SIGTERM and SIGINT set ``received`` (the first signal's
    number) instead of ending the process; on exit the previous handlers are restored."""

    def __init__(self) -> None:
        self.received = 0
        self.first_at = 0.0
        self.previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if not self.received:
            self.received, self.first_at = signum, now
        elif signum == signal.SIGINT and now - self.first_at >= SIGINT_GRACE_S:
            self.restore()
            raise KeyboardInterrupt

    def __enter__(self) -> SignalFlag:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self.previous = {}

    def __exit__(self, *exc: Any) -> None:
        self.restore()


class StopRules:
    """The early stops of a training loop: a signal (``flag``, None = no handler), ``exit_interval``
    iterations, ``exit_minutes`` of wall time since ``started`` (time.monotonic() of rank 0); and the saves
    ``save_minutes`` of wall time apart (--save-interval-minutes, rank 0's clock: ``save_due`` after each
    ``reason``, ``saved`` restarts the clock)."""

    def __init__(self, device: torch.device, flag: SignalFlag | None, exit_interval: int | None = None,
                 exit_minutes: float | None = None, started: float | None = None,
                 save_minutes: float | None = None) -> None:
        self.device, self.flag, self.exit_interval, self.exit_minutes = device, flag, exit_interval, exit_minutes
        self.started = time.monotonic() if started is None else started
        self.save_minutes, self.last_save, self.save_due = save_minutes, self.started, False

    @classmethod
    def of(cls, config: StoppingConfig, device: torch.device, save_minutes: float | None = None) -> StopRules:
        """From ``--exit-signal-handler``, ``--exit-interval`` and ``--exit-duration-in-mins``, and
        ``--save-interval-minutes`` (``save_minutes``)."""
        return cls(device, SignalFlag() if config.exit_signal_handler else None, config.exit_interval,
                   config.exit_duration_in_mins, save_minutes=save_minutes)

    def saved(self) -> None:
        """A checkpoint was saved: the next one is due ``save_minutes`` from now."""
        self.last_save, self.save_due = time.monotonic(), False

    def __enter__(self) -> StopRules:
        if self.flag is not None:
            self.flag.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.flag is not None:
            self.flag.__exit__(*exc)

    def minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    def reason(self, iteration: int) -> str | None:
        """Why the run stops after ``iteration``, or None; collective over the world group (one MAX
        all-reduce of three numbers when a signal handler, a duration or a save interval in minutes is set), the
        same on every rank, as is ``save_due``."""
        signum = self.flag.received if self.flag is not None else 0
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        late = float(self.exit_minutes is not None and rank0 and self.minutes() >= self.exit_minutes)
        due = float(self.save_minutes is not None and rank0 and
                    time.monotonic() - self.last_save >= 60 * self.save_minutes)
        if (self.flag is not None or self.exit_minutes is not None or self.save_minutes is not None) and \
                dist.is_initialized() and dist.get_world_size() > 1:
            agreed = torch.tensor([float(signum), late, due], device=self.device)
            with peers_named("the stop check"):  # a stuck or dead peer is named, as in train_step
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            signum, late, due = (int(v) for v in agreed.tolist())
        self.save_due = bool(due)
        if signum:
            return f"{signal.Signals(signum).name} received"
        if late:
            return f"--exit-duration-in-mins {self.exit_minutes:g} reached"
        if self.exit_interval and iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} reached"
        return None


def skipped_save(iteration: int, bad_steps: int, latest: str | None) -> str:
    """The line said instead of saving the checkpoint of ``iteration`` after ``bad_steps`` skipped steps."""
    return (f"save at iteration {iteration} skipped: the last {bad_steps} steps were skipped (non-finite); "
            + (f"the last checkpoint stays {latest}" if latest else "no checkpoint saved yet"))


class Diverged(SystemExit):
    """The run diverged: ``--max-skipped-steps`` steps in a row were skipped. Exit status 1 when
    uncaught (no traceback); ``message`` is the line already printed on stderr by rank 0."""

    def __init__(self, message: str) -> None:
        super().__init__(1)
        self.message = message


def check_divergence(engine: Any, max_skipped: int, iteration: int, health: Health,
                     start: str = "start again") -> None:
    """Raise ``Diverged`` (after one line on stderr from rank 0) once ``engine.bad_steps`` (skipped steps) or
    ``health.zero_steps`` (steps whose gradients were all zero) reach ``max_skipped``; the line names the
    checkpoint to resume from (``Health.advice``; ``start``: what to do when none trains on). The same on every
    rank: every rank skips the same steps and sees the same losses."""
    scale = f", loss scale {engine.loss_scale:g}" if engine.scaler is not None else ""
    if engine.bad_steps >= max_skipped:
        what = (f"training diverged at iteration {iteration}: {engine.bad_steps} steps in a row skipped for a "
                f"non-finite loss or gradient norm (--max-skipped-steps {max_skipped}{scale})")
        fix = "with a lower --lr, a longer --lr-warmup-iters or --clip-grad, or --bf16 instead of --fp16"
    elif health.zero_steps >= max_skipped:
        what = (f"training stalled at iteration {iteration}: {health.zero_steps} steps in a row with every "
                f"gradient zero, which learn nothing (--max-skipped-steps {max_skipped}{scale})")
        fix = ("with a loss scale the gradients do not underflow in (a larger --loss-scale, or none: dynamic "
               "scaling), or --bf16 instead of --fp16")
    else:
        return
    message = f"{what}; {health.advice(start)} {fix}"
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)
    raise Diverged(message)
