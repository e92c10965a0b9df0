"""bench/checkpoint_hash.py (docs/benchmarks.md's command) runs at a tiny preset and prints its medians and ratios:
the time a save blocks and the time until it is published, against a plain DCP save."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_helpers import commands
from families import CAUSAL_LM

pytestmark = pytest.mark.tier("journey")



ROOT = Path(__file__).resolve().parents[2]


def test_checkpoint_hash_bench_reports_the_added_cost():
    shown = [c for c in commands("benchmarks.md") if "bench/checkpoint_hash.py" in c]
    assert shown == ["python bench/checkpoint_hash.py"], shown
    proc = subprocess.run([sys.executable, *shown[0].split()[1:], "--preset", CAUSAL_LM.preset, "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert re.fullmatch(rf"{CAUSAL_LM.preset}: [\d.]+M parameters, checkpoint [\d.]+ GB, load [\d.]+", lines[0]), \
        proc.stdout
    medians = {kind: float(re.fullmatch(rf"{kind} +median +([\d.]+) s  min +[\d.]+ s  saves [\d.]+", line).group(1))
               for kind, line in zip(("plain", "blocking", "published"), lines[1:4])}
    added = re.fullmatch(r"blocking added (-?[\d.]+)% \(medians\), -?[\d.]+% \(median of each pair's ratio\); "
                         r"published added (-?[\d.]+)% \(medians\), -?[\d.]+% \(median of each pair's ratio\);",
                         lines[4])
    assert added, proc.stdout
    for kind, figure in zip(("blocking", "published"), added.groups()):
        assert abs(float(figure) - 100 * (medians[kind] / medians["plain"] - 1)) < 1.0, proc.stdout
    assert medians["blocking"] <= medians["published"], proc.stdout
