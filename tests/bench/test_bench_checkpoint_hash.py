"""bench/checkpoint_hash.py (docs/benchmarks.md's command) runs at a tiny preset and prints its medians and ratios."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from doc_helpers import commands

ROOT = Path(__file__).resolve().parents[2]


def test_checkpoint_hash_bench_reports_the_added_cost():
    shown = [c for c in commands("benchmarks.md") if "bench/checkpoint_hash.py" in c]
    assert shown == ["python bench/checkpoint_hash.py"], shown
    proc = subprocess.run([sys.executable, *shown[0].split()[1:], "--preset", "gpt-tiny", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"gpt-tiny: [\d.]+M parameters, checkpoint [\d.]+ GB, load [\d.]+", lines[0]), proc.stdout
    medians = [float(re.fullmatch(rf"{kind} +median +([\d.]+) s  min +[\d.]+ s  saves [\d.]+  CPU s [\d.]+",
                                  line).group(1)) for kind, line in zip(("plain", "hashed"), lines[1:3])]
    added = float(re.fullmatch(r"added (-?[\d.]+)% \(medians\), -?[\d.]+% \(minima\), -?[\d.]+% \(median of "
                               r"each pair's ratio\); hashing CPU -?[\d.]+ s", lines[3]).group(1))
    assert abs(added - 100 * (medians[1] / medians[0] - 1)) < 1.0, proc.stdout
