"""bench/kernel_speed.py runs on a CPU (small shapes, Triton's interpreter) and prints every kernel; it skips
rows whose estimated memory exceeds the GPU's free memory."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.tier("journey")



ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"scaled_masked_softmax", "scaled_causal_softmax", "layer_norm", "rms_norm", "gelu", "bias_gelu"}


def test_bench_prints_every_kernel_forward_and_backward():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TPZOO_KERNELS")}
    out = subprocess.run([sys.executable, "bench/kernel_speed.py"], cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": ""},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "copy bandwidth (measured, read + write):" in out.stdout
    header, _, *rows = [line for line in out.stdout.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[-6:] == ["Triton us", "GB/s", "% of copy", "eager / Triton", "compile / Triton", "rel diff"]
    cells = [dict(zip(columns, (c.strip() for c in row.strip("|").split("|")))) for row in rows]
    assert {(c["kernel"], c["pass"]) for c in cells} == {(k, p) for k in KERNELS for p in ("fwd", "bwd")}
    for c in cells:  # every number is a positive, finite measurement; Triton agrees with eager (fp32)
        assert all(0 < float(c[k]) < float("inf") for k in columns[-6:-1]), c
        assert float(c["rel diff"]) < 1e-5, c


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernel_speed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.tier("unit")
def test_bench_skips_rows_that_do_not_fit_in_free_memory():
    bench = load_bench()
    gib = 2**30
    # the bf16 causal softmax over [1, 8, 16384, 16384] (2^31 elements): 8 bf16 + 6 float32 tensors of its size
    assert bench.row_bytes(2**31, torch.bfloat16) == 2**31 * (8 * 2 + 6 * 4) == 80 * gib
    assert bench.skip_reason(2**31, torch.bfloat16, 79 * gib) == "skipped: needs 80.0 GiB, 79.0 GiB free"
    assert bench.skip_reason(2**31, torch.bfloat16, 139 * gib) is None  # an H200 runs it
    assert bench.skip_reason(2**30, torch.float32, 56 * gib) is None  # fp32 [1, 16, 8192, 8192]: exactly fits
    assert bench.skip_reason(2**30, torch.float32, 56 * gib - 1) == "skipped: needs 56.0 GiB, 56.0 GiB free"
    assert bench.skip_reason(2**40, torch.float32, None) is None  # off CUDA nothing is checked
    assert bench.free_bytes(torch.device("cpu")) is None
    rows = bench.cases(torch.float32, torch.device("cpu"))
    assert all(row.build().inputs[0].numel() == row.numel for row in rows)  # sized before anything is allocated
    line = bench.note_row(rows[0], "bf16", "skipped: needs 80.0 GiB, 79.0 GiB free")
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells == [rows[0].kernel, rows[0].shape, "bf16", "skipped: needs 80.0 GiB, 79.0 GiB free"] + [""] * 6
