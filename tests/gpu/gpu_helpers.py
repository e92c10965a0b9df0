"""The GPU suite's device, the environment of its subprocesses, and running them.

DEVICE is "cuda" unless TPZOO_GPU_SUITE_DEVICE=cpu asks for the CPU (to check the suite itself
on a machine without a GPU; see conftest.py). Every command of the suite runs as a subprocess
with ``env()``: Triton compiles its kernels there (no TRITON_INTERPRET, no TPZOO_KERNELS from
the parent), and on the CPU no GPU is visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from doc_helpers import ROOT, clean_env
from families import CAUSAL_LM, MASKED_LM
from pretrain_helpers import PRETRAIN

DEVICES = ("cuda", "cpu")
DEVICE = os.environ.get("TPZOO_GPU_SUITE_DEVICE", "cuda")
GPU_DIR = Path(__file__).resolve().parent
THREADS = 2
TIMEOUT = 300  # seconds, for any one command of the suite
# tiny models, a few dozen iterations, checkpoints at 20 and 40; no dropout (a resume repeats the run)
PRETRAIN_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --global-batch-size 16 "
                  "--micro-batch-size 8 --hidden-dropout 0 --attention-dropout 0 --lr-warmup-iters 2 "
                  "--log-interval 1 --train-iters 40 --eval-interval 20 --eval-iters 2 --save-interval 20").split()
# (model, precision) -> attention backend: each model runs the fused softmax kernels once and sdpa once
PRETRAIN_RUNS = {(CAUSAL_LM.family, "bf16"): "auto", (CAUSAL_LM.family, "fp16"): "fused-softmax",
                 (MASKED_LM.family, "bf16"): "fused-softmax", (MASKED_LM.family, "fp16"): "auto"}


def env(**extra: str) -> dict[str, str]:
    """os.environ for a command of the suite: TRITON_INTERPRET and TPZOO_KERNELS dropped (tests/conftest.py
    sets the first in this process), the repository and tests/gpu (the on_cuda plugin) importable, no model
    hub (a folder name is never looked up online), no GPU visible when DEVICE is cpu; ``extra`` added."""
    out = {k: v for k, v in clean_env(THREADS).items() if k not in ("TRITON_INTERPRET", "TPZOO_KERNELS")}
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(GPU_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
    out["HF_HUB_OFFLINE"] = "1"
    if DEVICE == "cpu":
        out["CUDA_VISIBLE_DEVICES"] = ""
    return {**out, **extra}


def run(args: list[str], cwd: Path, timeout: float = TIMEOUT, **extra_env: str) -> subprocess.CompletedProcess:
    """Run ``args`` (python and its arguments) in ``cwd``; fail with its output unless it exits 0."""
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env(**extra_env), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (f"`{' '.join(args)}` exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-5000:]}")
    return done


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def compiled_kernels(cache_dir: Path) -> set[str]:
    """Names of the Triton kernels compiled to GPU code in ``cache_dir`` (a TRITON_CACHE_DIR holds
    <hash>/<kernel>.cubin per compiled variant); Triton's interpreter writes nothing there."""
    return {p.stem for p in cache_dir.rglob("*.cubin")}


class Pretrained:
    """The pretrain.py runs of PRETRAIN_RUNS, each started when first asked for and kept for the session:
    ``pretrained(CAUSAL_LM.family, "bf16")`` -> its --save folder ``work/<family>-bf16`` (iter_0000020,
    iter_0000040, metrics.jsonl)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.failed: dict[tuple[str, str], Exception] = {}

    def flags(self, model: str, precision: str) -> list[str]:
        """The run's flags (a resume passes them again)."""
        return ["--model", model, f"--{precision}", "--attention-backend", PRETRAIN_RUNS[model, precision],
                *PRETRAIN_FLAGS]

    def triton_cache(self, model: str, precision: str) -> Path:
        """The run's own TRITON_CACHE_DIR."""
        return self.work / f"{model}-{precision}-triton-cache"

    def __call__(self, model: str, precision: str) -> Path:
        key, save = (model, precision), self.work / f"{model}-{precision}"
        if key in self.failed:  # each test that needs a failed run fails with its output, without a rerun
            raise self.failed[key]
        if not save.exists():
            try:
                run([PRETRAIN, *self.flags(model, precision), "--save", save.name], self.work,
                    TRITON_CACHE_DIR=str(self.triton_cache(model, precision)))
            except (AssertionError, subprocess.TimeoutExpired) as err:
                self.failed[key] = err
                raise
        return save
