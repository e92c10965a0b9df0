"""Wall-clock timers of the parts of an iteration, by ``--timing-log-level`` (Megatron-LM's timers).

    timers = Timers(level=1, device=mesh.device)
    timers.start("optimizer"); ...; timers.stop("optimizer")
    timers.collect(iterations, "minmax")    # on every rank: {"time/optimizer": max s, "time/optimizer/min": ...}

A part is timed when its level (``LEVELS``) is at most the timing level; ``level=None`` times nothing.
Level 0: the whole iteration. 1: what runs about once per iteration: forward-backward (every
micro-batch, the pipeline schedule included), grads-sync (dp reduce, tied embedding, sequence-parallel
norms), optimizer (the update and publishing the weights), evaluate, save. 2: batch (reading the global
batch). On CUDA the device is synchronised at each start and stop, so a timer measures the kernels, not
their launch (the timers cost time: keep the level low for speed runs).

``collect`` gives seconds per iteration over the iterations since the last ``collect`` (what each rank
spent, divided by ``iterations``), over the ranks of ``group``: ``max`` the slowest rank's, ``minmax`` also
the fastest's (``/min``), ``all`` also each rank's (``/rank<r>``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

LEVELS = {"iteration": 0, "forward-backward": 1, "grads-sync": 1, "optimizer": 1, "evaluate": 1, "save": 1,
          "batch": 2}
OPTIONS = ("max", "minmax", "all")


class Timers:
    """Seconds spent in each named part (``LEVELS``) since the last ``collect``."""

    def __init__(self, level: int | None = None, device: torch.device | None = None) -> None:
        if level is not None and level not in (0, 1, 2):
            raise ValueError(f"the timing level must be 0, 1 or 2, got {level}")
        self.level, self.device = level, device
        self.names = [name for name, at in LEVELS.items() if level is not None and at <= level]
        self.seconds = dict.fromkeys(self.names, 0.0)
        self.started: dict[str, float] = {}

    def _now(self) -> float:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self, name: str) -> None:
        if name not in LEVELS:
            raise KeyError(f"unknown timer {name!r}; known: {list(LEVELS)}")
        if name in self.seconds:
            self.started[name] = self._now()

    def stop(self, name: str) -> None:
        if name in self.started:
            self.seconds[name] += self._now() - self.started.pop(name)

    def collect(self, iterations: int, option: str = "minmax", group: dist.ProcessGroup | None = None
                ) -> dict[str, float]:
        """``time/<name>`` seconds per iteration (see the module's docstring); a collective over ``group``
        (default the world) when it has more than one rank: every rank calls it at the same iterations."""
        if option not in OPTIONS:
            raise ValueError(f"the timing option must be one of {OPTIONS}, got {option!r}")
        if not self.names:
            return {}
        mine = torch.tensor([self.seconds[n] / max(iterations, 1) for n in self.names], dtype=torch.float64)
        self.seconds = dict.fromkeys(self.names, 0.0)
        ranks = [mine]
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            # float64 on the mesh's device (nccl takes CUDA tensors only)
            local = mine.to(self.device or "cpu")
            ranks = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(ranks, local, group=group)
        every = torch.stack([r.cpu() for r in ranks])  # [ranks, names]
        out: dict[str, float] = {}
        for k, name in enumerate(self.names):
            out[f"time/{name}"] = every[:, k].max().item()
            if option in ("minmax", "all"):
                out[f"time/{name}/min"] = every[:, k].min().item()
            if option == "all":
                out.update({f"time/{name}/rank{r}": every[r, k].item() for r in range(len(ranks))})
        return out
