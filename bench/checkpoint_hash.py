"""What the checkpoint manifest costs a save: saves of a model with its AdamW state, with and without it.

    python bench/checkpoint_hash.py                                  # gpt2-medium (355M parameters), 5 + 5 saves
    python bench/checkpoint_hash.py --preset gpt-tiny --repeats 1    # seconds: the test's run

One process (a 1-rank mesh), float32, AdamW state filled by one training step (micro batch 1), saved
alternately two ways, each fsynced (DCP's default) and deleted before the next:

    plain     dcp.save of the same tensors: the save as it was before manifests
    manifest  save_checkpoint(background=True), as pretrain.py saves: "blocking" is the time until it
              returns (what the training loop waits for); "published" until wait_for_save returns, with
              nothing else running (the hashing, the manifest and the publication, not overlapped)

Prints every save's seconds and ``added = manifest / plain - 1`` of the medians and the median of each
adjacent pair's ratio, for "blocking" (the issue's bound: 10%) and for "published".
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
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tpzoo.checkpoint import save_checkpoint, wait_for_save  # noqa: E402
from tpzoo.checkpoint.optimizer import optimizer_entries  # noqa: E402
from tpzoo.checkpoint.rng import rng_items  # noqa: E402
from tpzoo.checkpoint.tensors import model_entries, save_items  # noqa: E402
from tpzoo.engine import Engine, EngineConfig  # noqa: E402
from tpzoo.models.families import PRESETS, family  # noqa: E402
from tpzoo.models.presets import get_preset, preset_family  # noqa: E402
from tpzoo.models.build import build_model  # noqa: E402
from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed  # noqa: E402


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


def timed_save(engine: Engine, folder: Path, kind: str) -> tuple[float, float, int]:
    """(seconds until the save returns, seconds until it is published, bytes) of one save into ``folder``
    (deleted afterwards)."""
    start = time.perf_counter()
    if kind == "plain":
        mesh = engine.mesh
        entries = [e for c in engine.chunks for e in model_entries(c.model, mesh, weights=engine.main.weights(c.model))]
        dcp.save({**save_items(entries + optimizer_entries(engine), mesh), **rng_items(mesh)}, checkpoint_id=folder)
        blocking = published = time.perf_counter() - start
    else:
        folder = save_checkpoint(folder, 1, engine, meta={}, background=True)
        blocking = time.perf_counter() - start
        wait_for_save()
        published = time.perf_counter() - start
    size = sum(p.stat().st_size for p in folder.iterdir())
    shutil.rmtree(folder.parent if kind != "plain" else folder)
    return blocking, published, size


def _row(name: str, values: list[float]) -> str:
    return (f"{name:9s} median {statistics.median(values):8.3f} s  min {min(values):8.3f} s  saves "
            f"{' '.join(f'{v:.3f}' for v in values)}")


def save_bench_args(prog: str, doc: str, repeats: int) -> argparse.Namespace:
    """The flags of a bench of saves (this one, bench/save_blocking.py): --preset, --repeats (default ``repeats``),
    --dir."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--preset", default="gpt2-medium", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"saves of each kind, alternating (default {repeats})")
    parser.add_argument("--dir", type=Path, default=None, help="where to save (default: a temporary folder)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main() -> None:
    args = save_bench_args("checkpoint_hash.py", __doc__, 5)
    engine = engine_for(args.preset)
    params = sum(p.numel() for p in engine.chunks[0].model.parameters())
    root = Path(tempfile.mkdtemp(prefix="ckpt-hash-", dir=args.dir))
    times: dict[str, list[float]] = {"plain": [], "blocking": [], "published": []}
    try:
        for _ in range(args.repeats):
            times["plain"].append(timed_save(engine, root / "plain", "plain")[0])
            blocking, published, size = timed_save(engine, root / "manifest", "manifest")
            times["blocking"].append(blocking)
            times["published"].append(published)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.preset}: {params / 1e6:.1f}M parameters, checkpoint {size / 1e9:.3f} GB, "
          f"load {os.getloadavg()[0]:.1f}")
    for name, values in times.items():
        print(_row(name, values))
    added = {name: (statistics.median(times[name]) / statistics.median(times["plain"]) - 1,
                    statistics.median(m / p for p, m in zip(times["plain"], times[name])) - 1)
             for name in ("blocking", "published")}
    print(" ".join(f"{name} added {100 * a:.1f}% (medians), {100 * b:.1f}% (median of each pair's ratio);"
                   for name, (a, b) in added.items()))


if __name__ == "__main__":
    main()
