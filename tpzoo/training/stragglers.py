"""Stragglers (``--log-straggler``, Megatron-LM's flag): which rank the others wait for, and how long.

In a synchronous step every rank's wall time is the same: the fast ones wait in a collective for the slow one. So
each rank times its own work instead: the CPU time of its process over the step (the math of a CPU run, the
kernel launches of a GPU run; time blocked in a collective is no CPU time) plus the wall time it spent reading its
batch (a stalled read is a straggler too, and costs no CPU). Every log line the ranks all-gather their own work per
step since the last line (one all-gather of one number), and the line names the slowest rank and its lag over the
median of the other ranks: ``slowest_rank 3 | straggler lag 0.2100`` (seconds per step). A rank is said to lag when
its own work exceeds the others' median by more than ``LAG_SHARE`` of it; the run's last lines list those ranks.

    stragglers = Stragglers(enabled, device)
    stragglers.start(); with stragglers.reading(): batch = ...; ...; stragglers.stop()   # each step
    stats.update(stragglers.collect())                                                    # each log line: collective

Not measured: a GPU's kernels themselves (their times would include the waits of the collective kernels), so a
rank whose GPU alone is slow is not found.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

LAG_SHARE = 0.2  # a rank lags when its own work per step is more than 20% over the median of the others'


class Stragglers:
    """Each rank's own work per step (module docstring), gathered at each log line."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled, self.device = enabled, device
        self.own, self.steps, self.began, self.read_cpu, self.read_wall = 0.0, 0, 0.0, 0.0, 0.0
        self.lagged: dict[int, tuple[int, float, float]] = {}  # rank -> (lines lagging, largest lag, its median)
        self.lines = 0

    def start(self) -> None:
        if self.enabled:
            self.began, self.read_cpu, self.read_wall = time.process_time(), 0.0, 0.0

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Time the batch read: its wall time counts as own work, not its CPU time (counted once)."""
        cpu, wall = time.process_time(), time.perf_counter()
        yield
        self.read_cpu += time.process_time() - cpu
        self.read_wall += time.perf_counter() - wall

    def stop(self) -> None:
        if self.enabled:
            self.own += time.process_time() - self.began - self.read_cpu + self.read_wall
            self.steps += 1

    def collect(self) -> dict[str, float | int]:
        """Collective over the world group (where enabled): ``slowest_rank`` and ``straggler_lag`` (its own work per
        step less the median of the other ranks', seconds) since the last call; nothing when disabled or no step was
        timed."""
        if not self.enabled or not self.steps:
            return {}
        mine = torch.tensor([self.own / self.steps], dtype=torch.float64, device=self.device)
        ranks = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(ranks, mine)
        own = [t.item() for t in ranks]
        self.own, self.steps, self.lines = 0.0, 0, self.lines + 1
        slowest = max(range(len(own)), key=own.__getitem__)
        others = own[:slowest] + own[slowest + 1:]
        middle = statistics.median(others) if others else own[slowest]  # one rank: no lag
        lag = own[slowest] - middle
        if lag > LAG_SHARE * middle:
            count, worst, at = self.lagged.get(slowest, (0, 0.0, middle))
            self.lagged[slowest] = (count + 1, *max((worst, at), (lag, middle)))
        return {"slowest_rank": slowest, "straggler_lag": lag}

    def summary(self) -> list[str]:
        """The ranks that lagged, for the run's last lines (none: nothing to say)."""
        return [f"straggler: rank {rank} lagged in {count} of {self.lines} log lines, its own work at most {worst:.3f} "
                f"s per step over the median of the others ({100 * worst / max(at, 1e-9):.0f}% more)"
                for rank, (count, worst, at) in sorted(self.lagged.items())]
