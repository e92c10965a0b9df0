"""A family other than GPT and BERT (Llama, ``families.GQA_LM``) through the three scripts, as a user runs
them: ``pretrain.py --model`` of it trains on the demo corpus (2 ranks, tp 2 with sequence parallelism:
each rank holds one of the two kv heads), ``python -m tpzoo.generate`` continues a prompt from its
checkpoint, and ``finetune.py`` fine-tunes that checkpoint as a causal LM on jsonl text (its validation
loss is below the pretraining run's first loss: it starts from the trained weights).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import background
import pytest
from doc_helpers import ROOT
from families import GQA_LM
from pretrain_helpers import TINY, metrics, pretrain, run

from tpzoo.data import grammar

pytestmark = pytest.mark.tier("journey")



ITERS = 20
# the tiny shape of the other pretrain tests, in micro-batches of 4 (2 per step) to keep it quick
SAVE = "pretrained"  # the pretraining run's --save folder
FLAGS = TINY + ["--model", GQA_LM.family, "--num-query-groups", "2", "--sequence-parallel", "--micro-batch-size",
                "4", "--train-iters", str(ITERS), "--eval-interval", "10", "--eval-iters", "1", "--save", SAVE]


@background.fixture
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gqa")
    pretrain(FLAGS, root, (2, 1, 1))
    return root


def test_pretrain_llama_loss_falls(trained):
    logged = metrics(trained / SAVE)
    record = json.loads((trained / SAVE / f"iter_{ITERS:07d}" / "meta.json").read_text())["checkpoint"]
    print(f"{GQA_LM.family} losses:", [round(logged[i]["loss"], 3) for i in sorted(logged)])
    assert sorted(logged) == list(range(1, ITERS + 1)) and "val_loss" in logged[ITERS]
    assert logged[ITERS]["loss"] < logged[1]["loss"] - 0.3, (logged[1], logged[ITERS])
    assert record["model"]["class"] == GQA_LM.model and record["model"]["config"]["num_query_groups"] == 2
    assert record["model"]["plan"]["sequence_parallel"] and record["mesh"]["tp"] == 2


def test_generate_continues_a_prompt_from_the_llama_checkpoint(trained):
    done = run([sys.executable, "-m", "tpzoo.generate", "--load", SAVE, "--prompt", "the small dog",
                "--max-new-tokens", "4"], trained)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("the small dog") and len(done.stdout.strip()) > len("the small dog"), done.stdout


def test_finetune_llama_as_a_causal_lm(trained):
    for split, (n, seed) in {"train": (16, 1), "valid": (8, 2)}.items():
        (trained / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                        for t in grammar.corpus(n, seed)))
    done = run([sys.executable, str(ROOT / "finetune.py"), "--load", SAVE,
                "--train-data", "train.jsonl", "--valid-data", "valid.jsonl", "--epochs", "1", "--seq-length", "32",
                "--global-batch-size", "8", "--micro-batch-size", "4", "--log-dir", "ft"], trained)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(rf"fine-tuning {GQA_LM.family} \(causal-lm\) from {SAVE}: \d+ training samples", done.stdout), \
        done.stdout
    epoch = [r for r in map(json.loads, (trained / "ft" / "metrics.jsonl").read_text().splitlines()) if "epoch" in r]
    first = metrics(trained / SAVE)[1]["loss"]
    assert [r["epoch"] for r in epoch] == [1] and 0 < epoch[0]["val_loss"] < first, (epoch, first)
