"""Resuming a run with nothing but ``--load DIR --save DIR --train-iters N`` continues it exactly as it
was configured, on real text: documents of Python's standard-library documentation (no line breaks),
tokenised from jsonl with ``--dataset`` by a sentencepiece tokenizer trained here (not the demo one),
sequences of 48 tokens, global batch 12 of micro-batches of 2. Saved at iteration 4 of a
single-process run, resumed at (tp, pp, dp) = (2, 1, 2): the val loss right after loading and the
losses of iterations 5..8 equal the uninterrupted run's. Continued pretraining of a Hugging Face model: that
checkpoint through ``to-hf`` (its sentencepiece tokenizer written as tokenizer.json) and ``from-hf`` again is a
model folder that ``--load FOLDER --finetune`` trains from at iteration 0, reading the text with the folder's
tokenizer: its val loss before the first step and its losses are those of ``--load CHECKPOINT --finetune``.
"""

from __future__ import annotations

import re
import sys
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


def test_continued_pretraining_of_a_hugging_face_model_starts_from_its_weights(saved_run, tmp_path):
    convert = [sys.executable, "-m", "tpzoo.convert"]
    for direction, source, out in (("to-hf", saved_run / "whole" / f"iter_{SAVED:07d}", "hf"), ("from-hf", "hf", "tz")):
        done = run([*convert, direction, str(source), out], tmp_path)
        assert done.returncode == 0 and "with its tokenizer (tokenizer.json" in done.stdout, done.stdout + done.stderr
    refused = run(command(["--load", "tz", "--train-iters", "2"]), tmp_path)
    assert refused.returncode == 2 and "is a model folder (weights, no training run to resume); add --finetune" \
        in refused.stderr, refused.stderr
    data = ["--dataset", str(saved_run / "docs.jsonl"), "--data-cache-path", "cache"]  # no tokenizer flag: tz's own
    val = {}
    for load, mesh, flags in ((str(saved_run / "whole" / f"iter_{SAVED:07d}"), (1, 1, 1),
                                ["--tokenizer-model", str(saved_run / "stdlib.model")]), ("tz", (2, 1, 1), RUN)):
        done = pretrain(flags + data + ["--load", load, "--finetune", "--train-iters", "2", "--save", f"from-{mesh[0]}"],
                        tmp_path, mesh)
        found = re.search(rf"finetuning from {load} at iteration 0 \(consumed samples 0\): val loss (\S+)", done.stdout)
        assert found, done.stdout
        val[load] = float(found.group(1))
    from_checkpoint, from_folder = metrics(tmp_path / "from-1"), metrics(tmp_path / "from-2")
    assert sorted(from_folder) == sorted(from_checkpoint) == [1, 2]
    worst = max(rel(from_folder[i]["loss"], from_checkpoint[i]["loss"]) for i in (1, 2))
    print(f"val losses before training {val}; largest loss difference {worst:.1e}")
    assert rel(val["tz"], val[str(saved_run / "whole" / f"iter_{SAVED:07d}")]) <= 1e-5 and worst <= 1e-5
