"""How long a save blocks training, synchronous against ``--async-save``.

    python bench/save_blocking.py                                    # gpt2-medium (355M parameters), 3 + 3 saves
    python bench/save_blocking.py --preset gpt-tiny --repeats 1      # seconds: the test's run

One process (a 1-rank mesh), float32, the model and its AdamW state (filled by one training step of micro batch 1),
saved alternately as pretrain.py saves them (``save_checkpoint(background=True)``, files fsynced) without and with
``async_write`` (--async-save), each followed by one training step, each checkpoint deleted before the next:

    blocking    until ``save_checkpoint`` returns: what the training loop waits for (sync: the tensors written;
                async: the tensors copied out)
    step        the training step right after it, while the save goes on in the background (sync: hashing and
                publishing; async: writing too)
    published   until ``wait_for_save`` returns after that step: the checkpoint on disk and named by ``latest``
    alone       a training step with no save in flight

Prints each row's median and every save's seconds, then the ratio of the blocking medians, async / sync.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from checkpoint_hash import engine_for, save_bench_args  # bench/, the script's folder

from tpzoo.checkpoint import save_checkpoint, wait_for_save
from tpzoo.engine import Engine

ROWS = ("blocking", "step", "published")


def step(engine: Engine) -> float:
    """Seconds of one training step on a fixed batch of one 8-token sequence."""
    ids = torch.randint(0, engine.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    engine.train_step(dict(input_ids=ids, labels=ids))
    return time.perf_counter() - start


def timed_save(engine: Engine, root: Path, asynchronous: bool) -> tuple[dict[str, float], int]:
    """({row: seconds}, bytes) of one save into ``root`` (deleted afterwards) and the step after it."""
    start = time.perf_counter()
    folder = save_checkpoint(root, 1, engine, meta={}, background=True, async_write=asynchronous)
    blocking = time.perf_counter() - start
    stepped = step(engine)
    wait_for_save()
    published = time.perf_counter() - start
    size = sum(p.stat().st_size for p in folder.iterdir())
    shutil.rmtree(root)
    return dict(blocking=blocking, step=stepped, published=published), size


def _row(name: str, values: list[float]) -> str:
    return f"{name:16s} median {statistics.median(values):8.3f} s  saves {' '.join(f'{v:.3f}' for v in values)}"


def main() -> None:
    args = save_bench_args("save_blocking.py", __doc__, 3)
    engine = engine_for(args.preset)
    params = sum(p.numel() for p in engine.chunks[0].model.parameters())
    root = Path(tempfile.mkdtemp(prefix="save-blocking-", dir=args.dir))
    times = {f"{kind} {row}": [] for kind in ("sync", "async") for row in ROWS}
    alone = []
    try:
        for _ in range(args.repeats):
            alone.append(step(engine))
            for kind in ("sync", "async"):
                figures, size = timed_save(engine, root / kind, kind == "async")
                for row, seconds in figures.items():
                    times[f"{kind} {row}"].append(seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.preset}: {params / 1e6:.1f}M parameters, checkpoint {size / 1e9:.3f} GB, "
          f"load {os.getloadavg()[0]:.1f}")
    print(_row("step alone", alone))
    for name, values in times.items():
        print(_row(name, values))
    ratio = statistics.median(times["async blocking"]) / statistics.median(times["sync blocking"])
    print(f"async blocks {ratio:.3f}x as long as sync (medians)")


if __name__ == "__main__":
    main()
