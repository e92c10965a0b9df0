"""bench/kernels.py runs on a CPU (small shapes, Triton's interpreter) and prints every kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"scaled_masked_softmax", "scaled_causal_softmax", "layer_norm", "rms_norm", "gelu", "bias_gelu"}


def test_bench_prints_every_kernel_forward_and_backward():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TPZOO_KERNELS")}
    out = subprocess.run([sys.executable, "bench/kernels.py"], cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": ""},
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
