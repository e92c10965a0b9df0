"""Resuming a run with nothing but ``--load DIR --save DIR --train-iters N`` continues it exactly as it
was configured, on real text: documents of Python's standard-library documentation (no line breaks),
tokenised from jsonl with ``--dataset`` by a sentencepiece tokenizer trained here (not the demo one),
sequences of 48 tokens, global batch 12 of micro-batches of 2. Saved at iteration 4 of a
single-process run, resumed at (tp, pp, dp) = (2, 1, 2): the val loss right after loading and the
losses of iterations 5..8 equal the uninterrupted run's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pretrain_helpers import metrics, pretrain, rel, run, command
from real_text import documents, write_jsonl

from tpzoo.data.tokenizer import train_tokenizer

pytestmark = pytest.mark.tier("journey")



ITERS, SAVED = 8, 4
RUN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 48 --global-batch-size 12 "
       "--micro-batch-size 2 --hidden-dropout 0 --attention-dropout 0 --lr 2e-3 --lr-warmup-iters 2 --log-interval 1 "
       f"--eval-interval 2 --eval-iters 1 --split 90,10,0 --save-interval {SAVED} --seed 7").split()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    texts = documents()
    write_jsonl(root / "docs.jsonl", texts)
    train_tokenizer([str(root / "docs.jsonl")], str(root / "stdlib"), 700)
    data = ["--dataset", "docs.jsonl", "--tokenizer-model", "stdlib.model", "--data-cache-path", "cache"]
    pretrain(RUN + data + ["--train-iters", str(ITERS), "--save", "whole"], root)
    return root


def test_resume_with_only_load_save_iters_continues_the_run_on_another_mesh(saved_run):
    root = saved_run
    done = pretrain(["--load", f"whole/iter_{SAVED:07d}", "--save", "resumed", "--train-iters", str(ITERS)], root,
                    (2, 1, 2))
    found = re.search(rf"resumed from \S+ at iteration {SAVED} \(consumed samples {SAVED * 12}\): val loss (\S+)",
                      done.stdout)
    assert found, done.stdout
    assert "change" not in done.stdout, "a resume without data flags must not report a changed run:\n" + done.stdout
    whole, resumed = metrics(root / "whole"), metrics(root / "resumed")
    assert sorted(resumed) == list(range(SAVED + 1, ITERS + 1))
    val_diff = rel(float(found.group(1)), whole[SAVED]["val_loss"])
    worst = max(rel(resumed[i][k], whole[i][k]) for i in resumed for k in ("loss", "val_loss") if k in whole[i])
    print(f"resumed at (2,1,2): val loss relative difference {val_diff:.1e}, largest loss difference {worst:.2e}")
    assert val_diff <= 1e-6 and worst <= 1e-5
    assert [resumed[i]["lr"] for i in resumed] == [whole[i]["lr"] for i in resumed]


def test_resume_names_the_flags_that_change_what_the_run_trains_on(saved_run):
    root = saved_run
    done = pretrain(["--load", "whole", "--save", "longer", "--train-iters", str(ITERS + 1), "--seq-length", "32",
                     "--split", "80,20,0", "--eval-interval", "0"], root)
    lines = [line for line in done.stdout.splitlines() if "--seq-length" in line]
    assert len(lines) == 1, done.stdout
    assert "--seq-length 32 (checkpoint: 48)" in lines[0] and "--split 80,20,0 (checkpoint: 90,10,0)" in lines[0]
    assert sorted(metrics(root / "longer")) == [ITERS + 1]


def test_resume_with_another_tokenizer_names_both_vocabularies(saved_run, tmp_path):
    other = train_tokenizer([str(saved_run / "docs.jsonl")], str(tmp_path / "other"), 600)
    done = run(command(["--load", str(saved_run / "whole"), "--save", "out", "--train-iters", str(ITERS + 1),
                        "--tokenizer-model", other, "--data-cache-path", "cache"]), tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "700 tokens" in done.stderr and "has 600" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
