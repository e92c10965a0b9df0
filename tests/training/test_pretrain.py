"""pretrain.py end to end on the CPU: the same losses on every mesh, resuming on another mesh, after
a SIGKILL, and misuse that ends in one line and exit status 2.

One single-process run and one 8-rank run at (tp, pp, dp) = (2, 2, 2) with ZeRO-1 train the same
tiny GPT for 12 iterations (float32, no dropout), saving at 6. The 8-rank checkpoint at 6 is then
resumed at (1, 1, 1) and (4, 2, 1) (2 more launches; test_pretrain_resume.py resumes at (2, 1, 2), the
checkpoint tests reshard over every mesh): the val loss right after loading and the training losses 7..12 must
match the uninterrupted run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path

import background
import pytest
from doc_helpers import run_as_needed
from pretrain_helpers import TINY, command, env, metrics, pretrain, rel

pytestmark = pytest.mark.tier("journey")



ITERS, SAVED = 12, 6
FLAGS = TINY + f"--train-iters {ITERS} --eval-interval 3 --eval-iters 2 --save-interval {SAVED}".split()
LOSS_TOL, VAL_TOL = 1e-5, 1e-6


@background.fixture
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pretrain")
    run_as_needed([shlex.join(command(FLAGS + ["--save", "single"])),  # both at once
                   shlex.join(command(FLAGS + ["--save", "3d", "--use-distributed-optimizer"], (2, 2, 2)))], root)
    return root


def test_8_ranks_log_the_single_process_losses(runs):
    one, three = metrics(runs / "single"), metrics(runs / "3d")
    assert sorted(one) == sorted(three) == list(range(1, ITERS + 1))
    assert [i for i in one if "val_loss" in one[i]] == [3, 6, 9, 12]
    worst = max(rel(three[i][key], one[i][key]) for i in one for key in ("loss", "val_loss") if key in one[i])
    print(f"largest relative loss difference (2,2,2) vs (1,1,1): {worst:.2e}")
    assert worst <= LOSS_TOL
    assert [one[i]["lr"] for i in one] == [three[i]["lr"] for i in one]
    assert one[ITERS]["loss"] < one[1]["loss"] - 0.2
    assert (runs / "3d" / "latest").read_text().strip() == f"iter_{ITERS:07d}"


@pytest.mark.parametrize("mesh", [(1, 1, 1), (4, 2, 1)], ids=lambda m: "tp%d-pp%d-dp%d" % m)
def test_resume_on_another_mesh_continues_the_run(runs, mesh, tmp_path):
    done = pretrain(FLAGS + ["--load", str(runs / "3d" / f"iter_{SAVED:07d}"), "--save", "resumed"], tmp_path, mesh)
    found = re.search(rf"resumed from \S+ at iteration {SAVED} \(consumed samples 48\): val loss (\S+)", done.stdout)
    assert found, done.stdout
    saved, resumed = metrics(runs / "3d"), metrics(tmp_path / "resumed")
    val_diff = rel(float(found.group(1)), saved[SAVED]["val_loss"])
    assert sorted(resumed) == list(range(SAVED + 1, ITERS + 1))
    worst = max(rel(resumed[i][key], saved[i][key]) for i in resumed for key in ("loss", "val_loss") if key in saved[i])
    print(f"resumed at {mesh}: val loss relative difference {val_diff:.1e}, largest loss difference {worst:.2e}")
    assert val_diff <= VAL_TOL and worst <= LOSS_TOL


def wait_for_save_then_kill(proc: subprocess.Popen, save_dir: Path, timeout: float = 120.0) -> int:
    """SIGKILL ``proc`` once a checkpoint exists and a later iteration was logged; returns the
    iteration of that checkpoint."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before it could be killed"
        latest = save_dir / "latest"
        if latest.is_file() and (save_dir / "metrics.jsonl").is_file():
            saved = int(latest.read_text().strip().split("_")[1])
            if max(metrics(save_dir), default=0) > saved:
                proc.kill()
                proc.wait()
                return saved
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("no checkpoint appeared in time")


def test_sigkill_then_load_logs_what_the_uninterrupted_run_logged(tmp_path):
    flags = TINY + "--train-iters 150 --eval-interval 25 --eval-iters 2 --save-interval 10".split()
    with open(tmp_path / "whole.err", "w+") as err:  # the uninterrupted run goes on beside the killed one
        whole = subprocess.Popen(command(flags + ["--save", "whole"]), cwd=tmp_path, env=env(),
                                 stdout=subprocess.DEVNULL, stderr=err)
        proc = subprocess.Popen(command(flags + ["--save", "killed"]), cwd=tmp_path, env=env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            saved = wait_for_save_then_kill(proc, tmp_path / "killed")
        finally:
            status = whole.wait(timeout=300)
        err.seek(0)
        assert status == 0, err.read()[-4000:]
    print(f"killed after the checkpoint at iteration {saved}")
    assert saved < 150
    pretrain(flags + ["--save", "killed", "--load", "killed"], tmp_path)
    fields = ("loss", "lr", "grad_norm", "val_loss")
    whole, resumed = metrics(tmp_path / "whole"), metrics(tmp_path / "killed")
    assert sorted(resumed) == sorted(whole)
    assert [[r.get(f) for f in fields] for r in resumed.values()] == [[r.get(f) for f in fields] for r in whole.values()]


MISUSE = {  # flags -> what stderr says
    "lr": ("--lr -1", "argument --lr: expected a number > 0, got -1"),
    "world": ("--tp 2", "world size 1 is not divisible by tp x pp"),
    "batch": ("--global-batch-size 10 --micro-batch-size 4", "global batch size 10 is not divisible"),
    "data": ("--data-path nowhere/corpus", "nowhere/corpus"),
    "no-checkpoint": ("--load empty", "holds no tpzoo checkpoint"),
    "other-model": ("--load {single} --hidden-size 64", "hidden_size: checkpoint 32, flags 64"),
}


@pytest.fixture(scope="module")
def misuse(runs, tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """Every MISUSE command, two at a time (most of each is loading torch), in one folder, each with
    its own ``--save out-<case>``."""
    root = tmp_path_factory.mktemp("misuse")
    (root / "empty").mkdir()
    commands = [shlex.join(command(TINY + flags.format(single=runs / "single").split() + ["--save", f"out-{case}"]))
                for case, (flags, _) in MISUSE.items()]
    return root, dict(zip(MISUSE, run_as_needed(commands, root, check=False)))


@pytest.mark.parametrize("case", MISUSE)
def test_misuse_ends_in_one_line_and_exit_2(misuse, case):
    root, done = misuse[0], misuse[1][case]
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("pretrain.py: error: "), done.stderr
    assert MISUSE[case][1] in done.stderr
    assert not (root / f"out-{case}").exists(), "misuse must stop before any training"
