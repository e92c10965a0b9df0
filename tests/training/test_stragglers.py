"""``--log-straggler`` (tpzoo.training.stragglers): a rank slowed on purpose (its batch reads sleep) is named in the
log within two log intervals, with its lag, and listed at the end; the lag arithmetic and the summary (unit)."""

from __future__ import annotations

import re
import subprocess
import sys

import background
import pytest
import torch
from doc_helpers import clean_env
from pretrain_helpers import PRETRAIN, TINY

from tpzoo.training import stragglers
from tpzoo.training.stragglers import Stragglers

pytestmark = pytest.mark.tier("journey")

SLOW_S, INTERVAL = 0.3, 2
# loaded by every Python process of the launch (PYTHONPATH): rank 1 sleeps in each read of a train batch
HOOK = f'''
import os
if os.environ.get("RANK") == "1" and os.environ.get("LOCAL_RANK") is not None:
    import time
    from tpzoo.training import setup
    read = setup.Run.batch
    def slow(self, dataset, start, size=None):
        if dataset is self.train:
            time.sleep({SLOW_S})
        return read(self, dataset, start, size)
    setup.Run.batch = slow
'''


@background.fixture
def slowed(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("stragglers")
    (root / "hook").mkdir()
    (root / "hook" / "sitecustomize.py").write_text(HOOK)
    env = {**clean_env(1), "PYTHONPATH": str(root / "hook")}
    done = subprocess.run(background.niced([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                            "--nproc-per-node=2", PRETRAIN, *TINY, "--train-iters", "6",
                                            "--log-interval", str(INTERVAL), "--log-straggler", "--save", "run"]),
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_the_slowed_rank_is_named_within_two_log_intervals(slowed):
    lines = {int(m[1]): m[0] for m in re.finditer(r"^iteration (\d+)/6 \|.*$", slowed, re.M)}
    named = [i for i, line in sorted(lines.items()) if re.search(r"slowest_rank 1 \| straggler lag 0\.[1-9]", line)]
    assert named and named[0] <= 2 * INTERVAL, slowed
    lag = float(re.search(r"straggler lag ([\d.]+)", lines[named[0]]).group(1))
    assert 0.6 * SLOW_S <= lag <= 3 * SLOW_S, lines[named[0]]


def test_the_run_lists_the_rank_that_lagged(slowed):
    assert re.search(r"^straggler: rank 1 lagged in [23] of 3 log lines, its own work at most 0\.\d+ s per step over "
                     r"the median of the others \(\d+% more\)$", slowed, re.M), slowed
    assert "straggler: rank 0" not in slowed


@pytest.mark.tier("unit")
def test_lag_over_the_median_and_the_summary(monkeypatch):
    own = [[0.10, 0.11, 0.50, 0.12], [0.10, 0.10, 0.10, 0.13], [0.20, 0.10, 0.10, 0.10]]
    line = iter(own)
    monkeypatch.setattr(stragglers.dist, "get_world_size", lambda: 4)

    def all_gather(out, mine):
        for t, v in zip(out, next(line)):
            t.fill_(v)
    monkeypatch.setattr(stragglers.dist, "all_gather", all_gather)
    s = Stragglers(True, torch.device("cpu"))
    assert s.collect() == {}  # no step timed
    results = []
    for _ in own:
        s.start(), s.stop()
        results.append(s.collect())
    assert results[0]["slowest_rank"] == 2 and results[0]["straggler_lag"] == pytest.approx(0.50 - 0.11)
    assert results[1]["slowest_rank"] == 3 and results[1]["straggler_lag"] == pytest.approx(0.03)  # 30%: lags
    assert results[2]["slowest_rank"] == 0 and results[2]["straggler_lag"] == pytest.approx(0.10)
    assert s.summary() == [
        "straggler: rank 0 lagged in 1 of 3 log lines, its own work at most 0.100 s per step over the median of the "
        "others (100% more)",
        "straggler: rank 2 lagged in 1 of 3 log lines, its own work at most 0.390 s per step over the median of the "
        "others (355% more)",
        "straggler: rank 3 lagged in 1 of 3 log lines, its own work at most 0.030 s per step over the median of the "
        "others (30% more)"]
    assert Stragglers(False, torch.device("cpu")).collect() == {}
