"""Running pretrain.py the way a user does (one process, or torchrun) and reading what it logged."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import background
from doc_helpers import ROOT, clean_env

PRETRAIN = str(ROOT / "pretrain.py")
# a model small enough for 8 gloo ranks on 2 cores; float32, no dropout: the same losses on every mesh
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --global-batch-size 8 "
        "--micro-batch-size 1 --hidden-dropout 0 --attention-dropout 0 --lr-warmup-iters 2 --log-interval 1").split()
MESH_FLAGS = ("--tp", "--pp", "--dp")
# one OpenMP thread per process: the tiny models gain nothing from more, and 8 ranks x 2 threads on
# 2 cores spin-wait each other to a crawl
THREADS = 1


def command(flags: list[str], mesh: tuple[int, int, int] = (1, 1, 1)) -> list[str]:
    """pretrain.py with ``flags``: one process (no mesh flags added), or at ``mesh`` (tp, pp, dp) under
    torchrun --standalone."""
    world = mesh[0] * mesh[1] * mesh[2]
    if world == 1:
        return [sys.executable, PRETRAIN, *flags]
    sizes = [arg for name, size in zip(MESH_FLAGS, mesh) for arg in (name, str(size))]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", PRETRAIN,
            *flags, *sizes]


def script(name: str = "pretrain") -> ModuleType:
    """The top-level script ``name``.py (pretrain.py, pretrain_gpt.py ...) as a module: the scripts are not part
    of the installed package, so the repository root is put on sys.path for the import only."""
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT))


def env() -> dict[str, str]:
    return clean_env(THREADS)


def run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(background.niced(cmd), capture_output=True, text=True, cwd=cwd, env=env(), timeout=timeout)


def pretrain(flags: list[str], cwd: Path, mesh: tuple[int, int, int] = (1, 1, 1)) -> subprocess.CompletedProcess:
    """Run pretrain.py to the end and fail with its output if it does not exit 0."""
    done = run(command(flags, mesh), cwd)
    assert done.returncode == 0, f"{' '.join(flags)} at {mesh} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def metrics(log_dir: Path) -> dict[int, dict]:
    """metrics.jsonl of ``log_dir`` by iteration."""
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, lines)}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)
