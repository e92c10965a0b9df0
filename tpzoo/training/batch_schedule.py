"""The global batch size of each iteration, from the samples consumed before it (Megatron-LM's
num-microbatches calculators), and the iterations a ``--train-samples`` run makes.

    constant                      B(c) = G                                        (--global-batch-size)
    --rampup-batch-size S I R     B(c) = S + I floor(c / (R / n))  for c <= R,  n = (G - S) / I increments
                                  B(c) = G                         for c >  R
    --step-batch-size-schedule    B(c) = b_k of the last threshold t_k <= c ("0:16 2.4B:320 ...": thresholds
                                  in tokens, divided by --seq-length, K/M/B/T = 1e3/1e6/1e9/1e12);
                                  G = the last b_k unless --global-batch-size is given (then equal to it)

c = samples consumed before the iteration (the data position, kept in checkpoints: a resume mid-ramp
goes on with the same batches). Every batch size must be a multiple of micro batch x dp (``check``).
``--train-samples N`` makes (Megatron-LM's ``update_train_iters``): N // G iterations at a constant
batch; with a ramp, iterations while c <= R and c <= N, then (N - c) // G more (a partial last batch
is dropped); with a step schedule, iterations while c < N.
"""

from __future__ import annotations

from dataclasses import dataclass

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_step_schedule(text: str | list[str], seq_length: int) -> tuple[tuple[int, int], ...]:
    """``"0:16 2.4B:320"`` (or its words) -> ((0, 16), (2.4e9 // seq_length, 320)): (threshold in samples,
    batch size), thresholds in tokens; ValueError naming the entry that is not THRESHOLD:BATCH."""
    def number(word: str) -> int:
        word = word.strip().upper()
        scale = SUFFIXES.get(word[-1:], 1)
        return int(float(word[:-1] if scale > 1 else word) * scale)

    steps = []
    for entry in " ".join([text] if isinstance(text, str) else text).replace(",", " ").split():
        threshold, _, batch = entry.partition(":")
        try:
            steps.append((number(threshold) // seq_length, number(batch)))
        except ValueError:
            raise ValueError(f"--step-batch-size-schedule entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. 2.4B:320)"
                             ) from None
    return tuple(sorted(steps))


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch size per iteration (see the module docstring); ``global_batch_size`` G is the batch
    after any ramp: evaluation batches and iteration-counted schedules use it."""

    global_batch_size: int
    rampup: tuple[int, int, int] | None = None       # (start, increment, samples)
    steps: tuple[tuple[int, int], ...] | None = None  # ((threshold samples, batch size), ...)

    def __post_init__(self) -> None:
        g = self.global_batch_size
        if self.rampup is not None:
            start, incr, samples = self.rampup
            if start < 1 or incr < 1 or samples < 0:
                raise ValueError(f"--rampup-batch-size {start} {incr} {samples}: start and increment must be >= 1, "
                                 f"samples >= 0")
            if start > g or (g - start) % incr:
                raise ValueError(f"--rampup-batch-size {start} {incr} {samples}: global batch size {g} - start {start} "
                                 f"= {g - start} must be >= 0 and divisible by the increment {incr}")
            if samples == 0 and start < g:
                raise ValueError(f"--rampup-batch-size {start} {incr} 0: a ramp from {start} to global batch size {g} "
                                 f"needs SAMPLES > 0 to ramp over; give SAMPLES > 0, or START {g} for no ramp")
        if self.steps is not None:
            thresholds = [t for t, _ in self.steps]
            if not self.steps or thresholds[0] != 0 or len(set(thresholds)) != len(thresholds):
                raise ValueError(f"--step-batch-size-schedule thresholds (samples) {thresholds} must start at 0 and "
                                 f"be distinct")
            if any(b < 1 for _, b in self.steps) or self.steps[-1][1] != g:
                raise ValueError(f"--step-batch-size-schedule batch sizes {[b for _, b in self.steps]} must be >= 1 "
                                 f"and end at --global-batch-size {g}; make them agree, or leave out "
                                 f"--global-batch-size (then the schedule's last size)")

    def batch_at(self, consumed: int) -> int:
        """The global batch size of the iteration that starts after ``consumed`` samples."""
        if self.rampup is not None:
            start, incr, samples = self.rampup
            if consumed > samples or start == self.global_batch_size:
                return self.global_batch_size
            per_increment = samples / ((self.global_batch_size - start) // incr)
            return start + int(consumed / per_increment) * incr
        if self.steps is not None:
            return next(b for t, b in reversed(self.steps) if consumed >= t)
        return self.global_batch_size

    def sizes(self) -> list[int]:
        """Every batch size the schedule can give (smallest first)."""
        if self.rampup is not None:
            start, incr, _ = self.rampup
            return list(range(start, self.global_batch_size + 1, incr))
        if self.steps is not None:
            return sorted({b for _, b in self.steps})
        return [self.global_batch_size]

    def check(self, micro_batch_size: int, dp: int) -> None:
        """ValueError naming the sizes unless every batch size is a multiple of micro batch x dp."""
        per = micro_batch_size * dp
        bad = [b for b in self.sizes() if b % per]
        if bad:
            raise ValueError(f"global batch sizes {bad} of the batch schedule are not multiples of micro batch size "
                             f"x dp = {micro_batch_size} x {dp} = {per}; choose sizes (start, increment, "
                             f"--global-batch-size) that are")

    def consumed_after(self, iterations: int, consumed: int = 0) -> int:
        """The samples consumed after ``iterations`` more iterations from ``consumed``."""
        if self.rampup is None and self.steps is None:
            return consumed + iterations * self.global_batch_size
        for _ in range(iterations):
            consumed += self.batch_at(consumed)
        return consumed

    def iterations(self, train_samples: int) -> int:
        """The iterations ``--train-samples`` makes (Megatron-LM's ``update_train_iters``)."""
        g, iterations, consumed = self.global_batch_size, 0, 0
        if self.steps is not None:
            while consumed < train_samples:
                consumed += self.batch_at(consumed)
                iterations += 1
            return iterations
        if self.rampup is None:
            return train_samples // g
        while consumed <= self.rampup[2] and consumed <= train_samples:
            consumed += self.batch_at(consumed)
            iterations += 1
        return iterations + max(0, train_samples - consumed) // g
