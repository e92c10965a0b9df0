"""docs/finetuning.md's recipe on real text, its commands as the page shows them at a small scale (``SMALL``:
fewer pretraining steps, one epoch, fewer labels, a smaller tokenizer): the standard library's docstrings
exported, a tokenizer trained on them, the naive Bayes baseline, and each route (a GPT and a BERT pretrained
on the docstrings, then fine-tuned as classifiers of the 7 families) end to end. What the page reports at full
scale was measured by the same commands (its dates and figures); here each run must say its route, its 7
classes and score every epoch. In the background from the start of the session (tests/background.py)."""

from __future__ import annotations

import json
import re
import shlex

import background
import pytest
from doc_helpers import ROOT, blocks, run_as_needed

from tpzoo.data.stdlib_docs import FAMILIES

pytestmark = pytest.mark.tier("journey")

DOC, RECIPE = "finetuning.md", "## A recipe on real text"
SMALL = {"--train-iters": "6", "--epochs": "1", "--per-class": "4", "--vocab-size": "800", "--eval-interval": "3",
         "--eval-iters": "1"}


def recipe() -> list[str]:
    return [line for block in blocks(DOC, "bash", section=RECIPE) for line in block.splitlines() if line.strip()]


def small(command: str) -> str:
    """``command`` with the values of the flags in ``SMALL`` replaced; a fine-tuning that takes finetune.py's
    default epochs (the recipe's) runs one."""
    words = shlex.split(command)
    scaled = [SMALL.get(before, word) for before, word in zip([""] + words, words)]
    return shlex.join(scaled + ["--epochs", SMALL["--epochs"]] * ("finetune.py" in words and "--epochs" not in words))


def saved(command: str) -> str:
    words = shlex.split(command)
    return words[words.index("--save") + 1]


@background.fixture
def ran(tmp_path_factory) -> tuple[object, list]:
    folder = tmp_path_factory.mktemp("recipe")
    for name in ("pretrain.py", "finetune.py", "bench"):
        (folder / name).symlink_to(ROOT / name)
    return folder, run_as_needed([small(c) for c in recipe()], folder)


def test_the_recipe_shows_the_data_the_baseline_and_both_routes():
    shown = recipe()
    scripts = [next(w for w in shlex.split(c) if w.endswith(".py") or w == "tpzoo.data") for c in shown]
    assert scripts.count("pretrain.py") == scripts.count("finetune.py") == 2 and "bench/naive_bayes.py" in scripts
    assert {"--model bert" in c for c in shown if "pretrain.py" in c} == {True, False}, shown
    assert all(small(c) != c for c in shown if "pretrain.py" in c or "finetune.py" in c), "nothing to scale down"


def test_each_route_classifies_the_families_and_scores_every_epoch(ran):
    folder, done = ran
    said = "".join(d.stdout for d in done)
    for model in ("GPTModel", "BertModel"):
        assert re.search(rf"so --load's {model} fine-tunes as \w+ForSequenceClassification", said), said[-3000:]
    assert said.count(f"{len(FAMILIES)} classes: {' '.join(sorted(FAMILIES))}") == 2, said[-3000:]
    for save in [saved(c) for c in recipe() if "finetune.py" in c]:
        scores = [json.loads(line) for line in (folder / save / "metrics.jsonl").read_text().splitlines()]
        assert [r["epoch"] for r in scores if "epoch" in r] == [1] and 0 <= scores[-1]["accuracy"] <= 1, scores


def test_the_baseline_beats_the_majority_class(ran):
    _, done = ran
    baseline = next(json.loads(d.stdout) for d in done if "naive_bayes.py" in d.args)
    assert baseline["classes"] == len(FAMILIES) and baseline["accuracy"] > baseline["majority_class"], baseline
