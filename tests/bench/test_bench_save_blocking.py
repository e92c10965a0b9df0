"""bench/save_blocking.py (docs/benchmarks.md's command) runs at a tiny preset and prints each row's median and the
ratio of the blocking medians, async / sync."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_helpers import clean_env, commands
from families import CAUSAL_LM

pytestmark = pytest.mark.tier("journey")

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("step alone", *(f"{kind} {row}" for kind in ("sync", "async") for row in ("blocking", "step", "published")))


def test_save_blocking_bench_reports_sync_against_async():
    shown = [c for c in commands("benchmarks.md") if "bench/save_blocking.py" in c]
    assert shown == ["python bench/save_blocking.py"], shown
    proc = subprocess.run([sys.executable, *shown[0].split()[1:], "--preset", CAUSAL_LM.preset, "--repeats", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env(1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert re.fullmatch(rf"{CAUSAL_LM.preset}: [\d.]+M parameters, checkpoint [\d.]+ GB, load [\d.]+", lines[0]), \
        proc.stdout
    medians = {}
    for row, line in zip(ROWS, lines[1:8]):
        found = re.fullmatch(rf"{row} +median +([\d.]+) s  saves [\d.]+ [\d.]+", line)
        assert found, (row, proc.stdout)
        medians[row] = float(found.group(1))
    ratio = re.fullmatch(r"async blocks ([\d.]+)x as long as sync \(medians\)", lines[8])
    assert ratio, proc.stdout
    a, b, half = medians["async blocking"], medians["sync blocking"], 5e-4  # printed to 3 decimals
    assert (a - half) / (b + half) - half <= float(ratio.group(1)) <= (a + half) / (b - half) + half, proc.stdout
    for kind in ("sync", "async"):
        assert medians[f"{kind} blocking"] <= medians[f"{kind} published"], proc.stdout
