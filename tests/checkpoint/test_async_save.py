"""``--async-save`` (docs/checkpoints.md): each checkpoint's tensors written on a thread once copied out.

Checked with pretrain.py: at tp 2 a run saving every iteration writes the same tensor files, meta.json and
checkpoint index (``.metadata`` but for its random save id and path) as the synchronous run, and logs the same losses;
a run killed with SIGKILL while a write is in flight keeps ``latest`` on the checkpoint before it, and resuming from
it gives the uninterrupted run's losses exactly. ``--save-interval-minutes``: the stop check's clock (unit).
"""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import time
from pathlib import Path

import background
import pytest
import torch
from doc_helpers import clean_env
from pretrain_helpers import TINY, command, metrics, pretrain

from tpzoo.training.stopping import StopRules

pytestmark = pytest.mark.tier("journey")

EVERY_STEP = TINY + "--train-iters 3 --save-interval 1".split()
# weights large enough that a write takes a while (about 40 MB a checkpoint with the optimizer state)
LARGE = TINY + "--hidden-size 256 --num-layers 4 --train-iters 12 --save-interval 1".split()


def index(folder: Path) -> tuple:
    """A checkpoint's ``.metadata`` without the parts every save draws anew (a save id, the folder written)."""
    meta = pickle.loads((folder / ".metadata").read_bytes())
    return meta.state_dict_metadata, meta.storage_data, meta.planner_data


@background.fixture
def both(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("async")
    for name, extra in (("sync", []), ("async", ["--async-save"])):
        pretrain(EVERY_STEP + extra + ["--save", name], root, mesh=(2, 1, 1))
    return root


def test_async_checkpoints_equal_the_synchronous_ones(both):
    for it in (1, 2, 3):
        a, s = (both / name / f"iter_{it:07d}" for name in ("async", "sync"))
        shards = sorted(p.name for p in s.glob("*.distcp"))
        assert shards == sorted(p.name for p in a.glob("*.distcp")) and len(shards) == 2
        for name in shards:
            assert (a / name).read_bytes() == (s / name).read_bytes(), (it, name)
        meta_a, meta_s = (json.loads((f / "meta.json").read_text()) for f in (a, s))
        flags_a, flags_s = meta_a.pop("args"), meta_s.pop("args")
        assert meta_a == meta_s and {k for k in flags_a if flags_a[k] != flags_s.get(k)} == {"save", "async_save"}
        assert index(a) == index(s)
        assert json.loads((a / "manifest.json").read_text())["files"].keys() == \
            json.loads((s / "manifest.json").read_text())["files"].keys()
    assert (both / "async" / "latest").read_text().strip() == "iter_0000003"
    one, two = metrics(both / "sync"), metrics(both / "async")
    assert [one[i]["loss"] for i in one] == [two[i]["loss"] for i in two]


@background.fixture
def killed(tmp_path_factory) -> dict:
    """The uninterrupted run, and one killed with SIGKILL as soon as a checkpoint after the second is being written
    (its ``.partial`` folder there), then resumed."""
    root = tmp_path_factory.mktemp("killed")
    pretrain(LARGE + ["--save", "whole"], root)
    save = root / "cut"
    proc = subprocess.Popen(background.niced(command(LARGE + ["--async-save", "--save", "cut"])), cwd=root,
                            env=clean_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, in_flight = time.monotonic() + 300, None
    while in_flight is None and proc.poll() is None and time.monotonic() < deadline:
        in_flight = next((p for p in save.glob("iter_*.partial") if int(p.name[5:12]) >= 3), None)
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    seen = dict(in_flight=in_flight, latest=(save / "latest").read_text().strip(), log=proc.stdout.read(),
                left=sorted(p.name for p in save.iterdir()))
    seen["resumed"] = pretrain(LARGE + ["--async-save", "--load", "cut"], root).stdout
    return dict(seen, root=root)


def test_a_write_killed_in_flight_leaves_latest_on_the_one_before(killed):
    assert killed["in_flight"] is not None, killed["log"][-3000:]
    cut = int(killed["in_flight"].name[5:12])
    assert killed["in_flight"].name in killed["left"], killed["left"]  # the kill hit the write: never published
    latest = int(killed["latest"][5:])
    assert latest < cut and (killed["root"] / "cut" / killed["latest"] / "manifest.json").is_file()


def test_the_resume_after_the_kill_is_exact(killed):
    latest = int(killed["latest"][5:])
    assert f"at iteration {latest} (consumed samples" in killed["resumed"], killed["resumed"][-2000:]
    whole, cut = metrics(killed["root"] / "whole"), metrics(killed["root"] / "cut")
    assert sorted(cut) == sorted(whole)
    assert [cut[i]["loss"] for i in sorted(cut)] == [whole[i]["loss"] for i in sorted(whole)]


@pytest.mark.tier("unit")
def test_save_interval_minutes_is_due_on_rank_0s_clock(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    rules = StopRules(torch.device("cpu"), None, save_minutes=0.5)
    assert rules.reason(1) is None and not rules.save_due
    clock[0] += 29
    rules.reason(2)
    assert not rules.save_due
    clock[0] += 1
    rules.reason(3)
    assert rules.save_due
    rules.saved()
    assert not rules.save_due
    clock[0] += 29.9
    rules.reason(4)
    assert not rules.save_due
