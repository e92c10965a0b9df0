"""The benchmarks on the device for a few steps: bench/models.py (tpzoo eager and compiled vs Hugging Face
and plain PyTorch, bf16) with tiny models of every family, bench/kernel_speed.py at small shapes
(bench_small_kernels.py)."""

from __future__ import annotations

import math

from doc_helpers import ROOT
from families import CASES, MAIN
from gpu_helpers import DEVICE, GPU_DIR, compiled_kernels, run

# bench/models.py: one tiny preset per family (the CPU smoke run's), every contender
BENCH_MODELS = tuple(dict.fromkeys(CASES[name].preset for name in MAIN))
BENCH_CONTENDERS = ("tpzoo", "tpzoo-compile", "plain", "plain-compile", "hf", "hf-compile")
KERNELS = {"scaled_masked_softmax", "scaled_causal_softmax", "layer_norm", "rms_norm", "gelu", "bias_gelu"}
BENCH_COLUMNS = ["Triton us", "GB/s", "% of copy", "eager / Triton", "compile / Triton", "rel diff"]
# Triton vs torch eager: float32 math in both, one rounding to the output dtype: within 2 units in its last place
REL_DIFF = {"fp32": 1e-5, "bf16": 2 * 2.0**-7}


def table(stdout: str) -> list[dict[str, str]]:
    """The rows of a Markdown table printed by a benchmark, as {column: cell}."""
    header, _, *rows = [line for line in stdout.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    return [dict(zip(columns, (c.strip() for c in row.strip("|").split("|")))) for row in rows]


def test_bench_models_runs_a_few_steps(tmp_path, device_name):
    """Every contender of every family at a tiny shape: bench/models.py exits 1 if a first loss disagrees."""
    done = run([str(ROOT / "bench" / "models.py"), "--models", ",".join(BENCH_MODELS), "--contenders",
                ",".join(BENCH_CONTENDERS), "--num-layers", "2", "--micro-batch-size", "4", "--seq-length", "128",
                "--steps", "3", "--warmup", "2"], tmp_path, timeout=840)
    print(done.stdout)
    cells = {(c["model"], c["contender"]): c for c in table(done.stdout)}
    assert set(cells) == {(m, c) for m in BENCH_MODELS for c in BENCH_CONTENDERS}, done.stdout
    # only a family without a plain PyTorch model skips (its plain rows); tpzoo and Hugging Face always run
    ran = [c for c in cells.values() if not c["ms/step"].startswith("skipped: no plain PyTorch")]
    assert all(c["contender"].startswith("plain") for c in cells.values() if c not in ran), done.stdout
    assert all(0 < float(c["ms/step"]) <= float(c["median ms"]) for c in ran), done.stdout
    header = done.stdout.splitlines()[0]
    assert header.startswith(f"device: {device_name}" if DEVICE == "cuda" else "device: CPU"), done.stdout
    if DEVICE == "cuda":
        assert "; bf16;" in header and "compile backend inductor" in header, done.stdout
        assert all(float(c["peak GiB"]) > 0 for c in ran), done.stdout
        if any(gpu in device_name for gpu in ("H100", "H200")):
            assert all(c["MFU"].endswith("%") for c in ran), done.stdout


def test_bench_kernels_runs_every_kernel_at_small_shapes(tmp_path):
    cache = tmp_path / "triton-cache"
    done = run([str(GPU_DIR / "bench_small_kernels.py")], tmp_path, TRITON_CACHE_DIR=str(cache))
    print(done.stdout)
    cells = table(done.stdout)
    dtypes = ["fp32", "bf16"] if DEVICE == "cuda" else ["fp32"]
    assert sorted((c["kernel"], c["dtype"], c["pass"]) for c in cells) == sorted(
        (k, d, p) for k in KERNELS for d in dtypes for p in ("fwd", "bwd")), cells
    for c in cells:
        assert all(0 < float(c[k]) < math.inf for k in BENCH_COLUMNS[:-1]), c
        assert float(c["rel diff"]) <= REL_DIFF[c["dtype"]], c
    if DEVICE == "cuda":
        assert done.stdout.startswith("device: ") and "CPU" not in done.stdout.splitlines()[0], done.stdout
        assert {"_softmax_fwd", "_softmax_bwd", "_norm_fwd", "_norm_bwd", "_gelu_kernel"} <= compiled_kernels(cache)
