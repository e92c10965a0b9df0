"""finetune.py on the device, one epoch each: the BERT of the pretrain runs as a classifier on the demo
task (its validation scores logits against labels on the device), the GPT as a causal LM on the demo
task's text exported by ``python -m tpzoo.data demo --export``."""

from __future__ import annotations

import math

import pytest
from doc_helpers import ROOT
from families import CAUSAL_LM, MASKED_LM
from gpu_helpers import jsonl, run

FINETUNE = str(ROOT / "finetune.py")


@pytest.fixture(autouse=True)
def datasets_installed() -> None:
    """finetune.py reads tasks and data files through the datasets package (tpzoo.data.sources)."""
    pytest.importorskip("datasets", reason="finetune.py reads its data with the datasets package, a tpzoo "
                                           "dependency missing here: pip install datasets")


def test_finetune_bert_classifier_validates_on_the_device(pretrained, work):
    run([FINETUNE, "--load", str(pretrained(MASKED_LM.family, "bf16")), "--task", "demo", "--seq-length", "32",
         "--epochs", "1", "--bf16", "--save", "bert-classifier"], work)
    log = jsonl(work / "bert-classifier" / "metrics.jsonl")
    scores = [r for r in log if "epoch" in r]
    print("validation:", scores)
    assert [r["epoch"] for r in scores] == [1]
    s = scores[0]
    assert 0.0 <= s["accuracy"] <= 1.0 and 0.0 <= s["f1"] <= 1.0 and 0.0 < s["val_loss"] < math.inf, s
    assert all(math.isfinite(r["loss"]) for r in log)
    assert (work / "bert-classifier" / "best").is_dir()


def test_finetune_gpt_causal_lm_on_the_demo_text(pretrained, demo_files, work):
    run([FINETUNE, "--load", str(pretrained(CAUSAL_LM.family, "bf16")),
         "--train-data", str(demo_files / "text_train.jsonl"), "--valid-data",
         str(demo_files / "text_valid.jsonl"), "--epochs", "1", "--seq-length", "32", "--lr", "1e-3", "--fp16",
         "--save", "gpt-causal-lm"], work)
    log = jsonl(work / "gpt-causal-lm" / "metrics.jsonl")
    scores = [r for r in log if "epoch" in r]
    print("train losses:", [round(r["loss"], 3) for r in log], "validation:", scores)
    assert [r["epoch"] for r in scores] == [1]
    val = scores[0]["val_loss"]
    assert 0.0 < val < math.inf and math.isclose(scores[0]["perplexity"], math.exp(val), rel_tol=1e-6)
    assert log[-1]["loss"] < log[0]["loss"], "the train loss did not fall"
