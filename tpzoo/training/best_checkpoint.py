"""Keep the best checkpoint of a run by a validation metric, and the last one.

    keeper = BestCheckpoint(save_dir, "accuracy", higher_is_better=True)
    keeper.update(iteration, engine, meta, value, last)     # collective, after each evaluation

``save_dir`` then holds ``iter_NNNNNNN`` folders and ``latest`` as ``save_checkpoint`` writes them,
plus ``best``, a symbolic link to the iteration folder of the best evaluation so far (ties keep
the earlier one): ``load_model(save_dir / "best")`` loads it. A checkpoint is written when an
evaluation improves on the best and after the last one; folders this run wrote that are neither
``best`` nor ``latest`` any more are removed, so at most two remain.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tpzoo.checkpoint import save_checkpoint
from tpzoo.engine import Engine

BEST = "best"


def point_best(save_dir: Path, folder: Path) -> None:
    """Make ``save_dir/best`` a relative link to ``folder``, replacing any older link at once."""
    link = save_dir / f".{BEST}.tmp"
    if link.is_symlink():
        link.unlink()
    link.symlink_to(folder.name, target_is_directory=True)
    os.replace(link, save_dir / BEST)


class BestCheckpoint:
    """Saves into ``save_dir`` when ``metric`` improves and at the end (see the module docstring)."""

    def __init__(self, save_dir: Path, metric: str, higher_is_better: bool, adapters_of: str | None = None) -> None:
        self.save_dir, self.metric, self.higher = Path(save_dir), metric, higher_is_better
        self.adapters_of = adapters_of  # LoRA's --save-adapters-only: the base checkpoint (``save_checkpoint``)
        self.best: float | None = None
        self.best_folder: Path | None = None
        self.written: list[Path] = []

    def improves(self, value: float) -> bool:
        return self.best is None or (value > self.best if self.higher else value < self.best)

    def update(self, iteration: int, engine: Engine, meta: dict[str, Any], value: float, last: bool,
               candidate: bool = True) -> Path | None:
        """Save if ``value`` (this evaluation's ``metric``) is the best yet or ``last``; returns the folder.
        ``candidate=False``: an evaluation that cannot become the best (saved only as the last)."""
        improved = candidate and self.improves(value)
        if not (improved or last):
            return None
        folder = save_checkpoint(self.save_dir, iteration, engine, meta=meta, adapters_of=self.adapters_of)
        if improved:
            self.best, self.best_folder = value, folder
        if dist.get_rank() == 0:
            if improved:
                point_best(self.save_dir, folder)
            for old in self.written:
                if old not in (folder, self.best_folder):
                    shutil.rmtree(old, ignore_errors=True)
        self.written = [f for f in dict.fromkeys([*self.written, folder]) if f in (folder, self.best_folder)]
        dist.barrier()
        return folder
