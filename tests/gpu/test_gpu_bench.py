"""The benchmarks on the device for a few steps: bench/models.py (tpzoo vs Hugging Face vs plain
PyTorch GPT, bf16) with a small model, bench/kernels.py at small shapes (bench_small_kernels.py)."""

from __future__ import annotations

import math

from doc_helpers import ROOT
from gpu_helpers import DEVICE, GPU_DIR, compiled_kernels, run

KERNELS = {"scaled_masked_softmax", "scaled_causal_softmax", "layer_norm", "rms_norm", "gelu", "bias_gelu"}
BENCH_COLUMNS = ["Triton us", "GB/s", "% of copy", "eager / Triton", "compile / Triton", "rel diff"]
# Triton vs torch eager: float32 math in both, one rounding to the output dtype: within 2 units in its last place
REL_DIFF = {"fp32": 1e-5, "bf16": 2 * 2.0**-7}
# the three models start from the same weights and batch: the same first loss up to bf16 autocast noise
FIRST_LOSS_RTOL = 2e-2


def table(stdout: str) -> list[dict[str, str]]:
    """The rows of a Markdown table printed by a benchmark, as {column: cell}."""
    header, _, *rows = [line for line in stdout.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    return [dict(zip(columns, (c.strip() for c in row.strip("|").split("|")))) for row in rows]


def test_bench_models_runs_a_few_steps(tmp_path, device_name):
    done = run([str(ROOT / "bench" / "models.py"), "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads",
                "4", "--vocab-size", "1024", "--batch-size", "4", "--seq-length", "128", "--steps", "3", "--warmup",
                "2", "--bf16"], tmp_path)
    print(done.stdout)
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
            if line.split() and line.split()[0] in ("tpzoo", "hf", "plain")}
    assert sorted(rows) == ["hf", "plain", "tpzoo"], done.stdout
    first = {name: float(cells[-1]) for name, cells in rows.items()}  # loss@0
    assert all(math.isclose(first[name], first["tpzoo"], rel_tol=FIRST_LOSS_RTOL) for name in first), first
    assert all(float(cells[1]) > 0 for cells in rows.values())  # best ms
    assert f"bf16; {device_name}" in done.stdout.splitlines()[0], done.stdout
    if any(gpu in device_name for gpu in ("H100", "H200")):
        assert all(cells[4].endswith("%") for cells in rows.values()), done.stdout  # MFU


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
