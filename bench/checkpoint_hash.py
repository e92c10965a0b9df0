"""What the checkpoint manifest costs: saves of a model with its AdamW state, hashed and not, alternating.

    python bench/checkpoint_hash.py                                  # gpt2-medium (355M parameters), 5 + 5 saves
    python bench/checkpoint_hash.py --preset gpt-tiny --repeats 1    # seconds: the test's run

One process (a 1-rank mesh), float32, AdamW state filled by one training step (micro batch 1). "hashed"
is ``save_checkpoint`` as it is: each shard hashed by the writer while it is written, then manifest.json;
"plain" is the same save with DCP's own ``FileSystemWriter`` (no shard hashed: its manifest lists
meta.json only). Each save is fsynced (DCP's default) and deleted before the next. Prints the wall and
CPU seconds of every save, and ``added = hashed / plain - 1`` of the medians, of the minima and the median
of each adjacent pair's ratio (the issue's bound: 10%), and the CPU seconds the hashing adds (the
median difference: what it costs on a machine of its own; on a shared machine the wall times wander).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tpzoo.checkpoint.save as save_module  # noqa: E402
from tpzoo.checkpoint import save_checkpoint  # noqa: E402
from tpzoo.engine import Engine, EngineConfig  # noqa: E402
from tpzoo.models.families import PRESETS, family  # noqa: E402
from tpzoo.models.presets import get_preset, preset_family  # noqa: E402
from tpzoo.models.pretrained import build_model  # noqa: E402
from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed  # noqa: E402


class PlainWriter(FileSystemWriter):
    """DCP's writer: nothing hashed."""

    hashes: dict = {}


def engine_for(preset: str) -> Engine:
    mesh = init_mesh(device_type="cpu")
    manual_seed(0, mesh)
    config = get_preset(preset, hidden_dropout=0.0, attention_dropout=0.0)
    model_class = family(preset_family(preset)).spec.pretrain_model
    engine = Engine(lambda plan, **stage: build_model(model_class, config, plan, **stage), config,
                    EngineConfig(micro_batch_size=1, global_batch_size=1, lr=1e-4), ParallelPlan(mesh, kernels="torch"))
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    engine.train_step(dict(input_ids=ids, labels=ids))  # fills AdamW's exp_avg, exp_avg_sq
    return engine


def timed_save(engine: Engine, folder: Path, hashed: bool) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process: every thread, bytes) of one save into ``folder``
    (deleted afterwards)."""
    save_module.HashingWriter = HASHING if hashed else PlainWriter
    start, cpu = time.perf_counter(), time.process_time()
    final = save_checkpoint(folder, 1, engine, meta={})
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    size = sum(p.stat().st_size for p in final.iterdir())
    shutil.rmtree(folder)
    return seconds, cpu, size


HASHING = save_module.HashingWriter


def main() -> None:
    parser = argparse.ArgumentParser(prog="checkpoint_hash.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt2-medium", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind, alternating (default 5)")
    parser.add_argument("--dir", type=Path, default=None, help="where to save (default: a temporary folder)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    engine = engine_for(args.preset)
    params = sum(p.numel() for p in engine.chunks[0].model.parameters())
    root = Path(tempfile.mkdtemp(prefix="ckpt-hash-", dir=args.dir))
    times: dict[str, list[float]] = {"plain": [], "hashed": []}
    cpu: dict[str, list[float]] = {"plain": [], "hashed": []}
    try:
        for _ in range(args.repeats):
            for kind in times:
                seconds, used, size = timed_save(engine, root / kind, kind == "hashed")
                times[kind].append(seconds)
                cpu[kind].append(used)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.preset}: {params / 1e6:.1f}M parameters, checkpoint {size / 1e9:.3f} GB, "
          f"load {os.getloadavg()[0]:.1f}")
    for kind, values in times.items():
        print(f"{kind:7s} median {statistics.median(values):8.3f} s  min {min(values):8.3f} s  saves "
              f"{' '.join(f'{v:.3f}' for v in values)}  CPU s {' '.join(f'{v:.3f}' for v in cpu[kind])}")
    pairs = statistics.median(h / p for p, h in zip(times["plain"], times["hashed"])) - 1
    added = [f(times["hashed"]) / f(times["plain"]) - 1 for f in (statistics.median, min)]
    print(f"added {100 * added[0]:.1f}% (medians), {100 * added[1]:.1f}% (minima), {100 * pairs:.1f}% (median of "
          f"each pair's ratio); hashing CPU {statistics.median(cpu['hashed']) - statistics.median(cpu['plain']):.3f} s")


if __name__ == "__main__":
    main()
