"""finetune.py ``--elastic``: a fine-tuning run started again (a machine lost or added under torchrun's elastic agent)
resumes from the newest intact checkpoint of its ``--save`` folder, at the mesh the new world size allows
(``tpzoo.training.elastic``), instead of starting over.

    resumed = resume(run, keeper)   # None: nothing saved yet (a first start), or without --elastic

A fine-tuning checkpoint is written after an epoch's validation when it improves on the best, after the last one,
and when the run stops early (a signal, ``--exit-interval``: mid-epoch). It records the iteration, the epoch and the
scores of every epoch validated so far (``history``). Iteration i of epoch e has trained i - (e - 1) x S of the
epoch's S batches: the run goes on with the next one, in the epoch's own order (``epoch_order``), at the lr of its
iteration, with the optimizer state, the loss scale and (on the same mesh) the RNG states it was saved with; an
epoch cut short by the stop is validated again when it ends, not counted twice (its stop's validation leaves the
history and the metrics.jsonl line of that iteration). The best checkpoint so far (``best``) stays the one to beat.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from tpzoo.checkpoint import latest_iteration, load_checkpoint, read_meta, resolve_checkpoint
from tpzoo.checkpoint.save import mesh_shape
from tpzoo.data.batches import num_batches
from tpzoo.training.best_checkpoint import BEST, BestCheckpoint
from tpzoo.training.elastic import mesh_change
from tpzoo.training.finetune_setup import FinetuneRun
from tpzoo.training.metrics import json_line


@dataclass
class Resumed:
    checkpoint: Path                 # the checkpoint resumed from
    iteration: int                   # the steps it had taken
    epoch: int                       # the epoch the run goes on with
    skip: int                        # the batches of that epoch already trained
    history: list[dict[str, float]] = field(default_factory=list)  # the scores of the epochs validated before it
    mesh_change: str | None = None   # the line naming the checkpoint's mesh and this one, where they differ

    def line(self) -> str:
        return (f"resumed from {self.checkpoint} at iteration {self.iteration}: epoch {self.epoch} goes on from its "
                f"batch {self.skip + 1}")


def drop_validation(path: Path, iteration: int, keys: list[str]) -> None:
    """Remove ``keys`` (a validation's numbers) from the metrics.jsonl line of ``iteration`` at ``path``, if any."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    kept = [json_line({k: v for k, v in r.items() if k not in keys}) if r.get("iteration") == iteration else line
            for r, line in zip(records, lines)]
    path.write_text("".join(line + "\n" for line in kept))


def resume(run: FinetuneRun, keeper: BestCheckpoint | None) -> Resumed | None:
    """Load the newest intact checkpoint of ``run.save_dir`` into ``run.engine`` (collective) and say where the run
    goes on (module docstring); ``keeper`` learns the best so far. None without ``--elastic`` or before any save.
    ValueError when the folder holds another fine-tuning (another route or labels)."""
    if not run.job.parallel.elastic or run.save_dir is None or latest_iteration(run.save_dir) is None:
        return None
    folder = resolve_checkpoint(run.save_dir, collective=True)
    meta = read_meta(folder)
    if (meta.get("finetune"), meta.get("label_names")) != (run.kind, run.label_names):
        raise ValueError(f"--save {run.save_dir} holds a {meta.get('finetune')} fine-tuning of labels "
                         f"{meta.get('label_names')}, this run is a {run.kind} one of {run.label_names}; resume it "
                         f"with its own flags or pass another --save")
    load_checkpoint(folder, run.engine, **run.job.checkpoint.load_options())
    steps = num_batches(len(run.train), run.engine.config.global_batch_size)
    iteration, epoch = meta["iteration"], meta["epoch"]
    done = iteration - (epoch - 1) * steps
    history = list(meta.get("history", []))
    if done >= steps:
        epoch, done = epoch + 1, 0
    else:  # stopped mid-epoch: the validation of the stop is redone when the epoch ends
        history = history[:-1]
    if keeper is not None:  # the folders named as the keeper names what it writes (it removes them when passed)
        keeper.written = [run.save_dir / folder.name]
        if (run.save_dir / BEST).exists():
            best = run.save_dir / (run.save_dir / BEST).readlink().name
            keeper.best, keeper.best_folder = read_meta(best)["scores"][keeper.metric], best
            keeper.written = list(dict.fromkeys([best, *keeper.written]))
    if done and dist.get_rank() == 0:  # the stop's validation is redone at the epoch's end: its numbers go
        drop_validation(run.log_dir / "metrics.jsonl", iteration, ["epoch", *meta["scores"]])
    change = mesh_change(meta["checkpoint"]["mesh"], mesh_shape(run.engine), iteration)
    return Resumed(folder, iteration, epoch, done, history, change)
