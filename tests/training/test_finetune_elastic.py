"""finetune.py ``--elastic`` (docs/elastic.md, tpzoo.training.finetune_resume): a fine-tuning run stopped mid-epoch at
2 ranks (dp 2; ``--exit-interval``, as a lost machine's SIGTERM stops it) and started again at 1 rank resumes from
its newest checkpoint at dp 1: it says where and on which mesh, every later loss equals the uninterrupted run's
within 1e-5, the cut epoch is validated once it ends, and the best checkpoint and scores equal the uninterrupted
run's. The tiny BERT of a 2-iteration pretrain.py run fine-tunes on the demo task."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import background
import pytest
from doc_helpers import ROOT, clean_env
from pretrain_helpers import TINY, pretrain, rel

pytestmark = pytest.mark.tier("journey")

FINETUNE = str(ROOT / "finetune.py")
STOP_AT, EPOCHS = 3, 2
FLAGS = ["--load", "pre", "--task", "demo", "--epochs", str(EPOCHS), "--global-batch-size", "8",
         "--micro-batch-size", "4", "--seq-length", "16", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--log-interval", "1", "--elastic"]


def finetune(root: Path, save: str, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc-per-node={ranks}"]
    done = subprocess.run(background.niced([*launch, FINETUNE, *FLAGS, "--save", save, *extra]), cwd=root,
                          env=clean_env(1), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@background.fixture
def resumed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("finetune-elastic")
    pretrain(["--model", "bert", *TINY, "--train-iters", "2", "--save", "pre"], root)
    whole = finetune(root, "whole", 1)
    stopped = finetune(root, "cut", 2, "--exit-interval", str(STOP_AT))
    again = finetune(root, "cut", 1)
    return dict(root=root, whole=whole.stdout, stopped=stopped.stdout, again=again.stdout)


def test_the_restart_resumes_where_the_stop_saved(resumed):
    assert f"stopped at iteration {STOP_AT} (epoch 1)" in resumed["stopped"], resumed["stopped"][-2000:]
    assert re.search(rf"resumed from \S+iter_{STOP_AT:07d} at iteration {STOP_AT}: epoch 1 goes on from its batch "
                     rf"{STOP_AT + 1}\n", resumed["again"]), resumed["again"][-3000:]
    assert (f"re-meshed: iteration {STOP_AT} was saved on pp 1 x dp 2 x tp 1 (2 ranks), the run goes on on pp 1 x "
            f"dp 1 x tp 1 (1 ranks)") in resumed["again"]


def test_every_later_loss_equals_the_uninterrupted_run(resumed):
    whole = {r["iteration"]: r for r in lines(resumed["root"] / "whole")}
    cut = lines(resumed["root"] / "cut")
    later = [r for r in cut if r["iteration"] > STOP_AT]
    assert [r["iteration"] for r in later] == [i for i in sorted(whole) if i > STOP_AT]
    worst = max(rel(r["loss"], whole[r["iteration"]]["loss"]) for r in cut)
    print(f"largest relative loss difference, resumed at dp 1 vs uninterrupted: {worst:.2e}")
    assert worst <= 1e-5
    validated = [(r["epoch"], r["iteration"]) for r in cut if "epoch" in r]  # the stop's validation is gone
    assert validated == [(r["epoch"], i) for i, r in sorted(whole.items()) if "epoch" in r]  # each epoch's end once
    assert [r["iteration"] for r in cut] == sorted(whole)
    for r in later:
        if "epoch" in r:
            assert rel(r["accuracy"], whole[r["iteration"]]["accuracy"]) <= 1e-6


def test_the_best_checkpoint_is_the_uninterrupted_runs(resumed):
    best = [re.search(r"best accuracy ([\d.]+) \(epoch (\d+)\)", resumed[k]).groups() for k in ("whole", "again")]
    assert best[0] == best[1], best
    root = resumed["root"]
    assert (root / "cut" / "best").readlink() == (root / "whole" / "best").readlink()
