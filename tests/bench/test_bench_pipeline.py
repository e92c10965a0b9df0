"""bench/pipeline.py: the measured bubble follows the theory and in-flight micro-batches meet their bounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pipeline_bench_matches_theory():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "pipeline.py"), "--stages", "2", "--microbatches", "4",
                           "--fwd-ms", "40"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"gpipe", "1f1b", "interleaved-1f1b"}, proc.stdout
    for name, cols in rows.items():
        bubble, theory = float(cols[2]), float(cols[3])
        peaks, bounds = cols[6:8], cols[8:10]
        assert abs(bubble - theory) < 0.1, f"{name}: bubble {bubble} far from theory {theory}\n{proc.stdout}"
        assert peaks == bounds, f"{name}: peak in-flight {peaks} != bound {bounds}\n{proc.stdout}"
    assert rows["gpipe"][6:8] == ["4", "4"] and rows["1f1b"][6:8] == ["2", "1"]


def test_pipeline_bench_rejects_too_few_microbatches():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "pipeline.py"), "--stages", "4", "--microbatches", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("pipeline.py: error: need --stages >= 2 and --microbatches >= "
                                                    "--stages, got 4 and 2")
