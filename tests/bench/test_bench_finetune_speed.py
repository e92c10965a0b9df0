"""bench/finetune_speed.py (docs/benchmarks.md's command) at 2 steps a run of 8 x 32 tokens: a row per run, each ratio its
tokens/s over pretraining's. The ratios themselves are docs/benchmarks.md's measurement: timings are not asserted
here, where the suite's background jobs share the two cores with the runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_helpers import commands

pytestmark = pytest.mark.tier("journey")

ROOT = Path(__file__).resolve().parents[2]
ROUTES = ("pretraining", "causal LM (text)", "instruction tuning", "classifier (demo task)")


def test_finetune_speed_bench_reports_each_route_against_pretraining():
    shown = [c for c in commands("benchmarks.md") if "bench/finetune_speed.py" in c]
    assert shown == ["python bench/finetune_speed.py"], shown
    done = subprocess.run([sys.executable, *shown[0].split()[1:], "--iters", "2", "--steps", "2", "--seq-length", "32",
                           "--global-batch-size", "8"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {m[1]: (float(m[2].replace(",", "")), float(m[3]))
            for m in re.finditer(r"^\| ([^|]+?) \| ([\d,]+) \| ([\d.]+) \|$", done.stdout, re.M)}
    assert list(rows) == list(ROUTES), done.stdout
    base = rows["pretraining"][0]
    for name, (speed, ratio) in rows.items():
        # the speeds are printed rounded to whole tokens/s, the ratio to 0.01, both from the unrounded speeds
        slack = 0.005 + speed / base * (0.5 / speed + 0.5 / base)
        assert speed > 0 and abs(ratio - speed / base) <= slack, (name, done.stdout)
