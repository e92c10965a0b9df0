"""pretrain.py logs each part of BERT's loss (``mlm_loss`` + ``sop_loss`` = ``loss``, ``val_`` ones on eval
lines) and compares the MLM loss with the unigram entropy; ``--train-iters 0`` saves the untrained model as
the checkpoint of iteration 0, and a run loaded from it logs what an uninterrupted run logs. Megatron-LM's
``--bert-no-binary-head`` trains the MLM loss alone, its checkpoint resumes as it was and fine-tunes.

Three launches of a tiny BERT: 4 iterations; 0 iterations (the control run); 2 iterations from its checkpoint.
Without the binary head: 4 iterations, 2 more resumed, one epoch of finetune.py's demo task; from a model folder
saved without it: 2 iterations, 1 more resumed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from doc_helpers import ROOT
from families import CAUSAL_LM, MASKED_LM, MASKED_LM_ONLY
from pretrain_helpers import TINY, metrics, pretrain, run

pytestmark = pytest.mark.tier("journey")



BERT = TINY + f"--model {MASKED_LM.family} --eval-interval 2 --eval-iters 1".split()


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("masked-lm")
    done = pretrain(BERT + ["--train-iters", "4", "--save", "run"], root)
    return root, done.stdout


def test_bert_logs_mlm_and_sop_parts_adding_up_to_the_loss(bert_run):
    lines = metrics(bert_run[0] / "run")
    assert sorted(lines) == [1, 2, 3, 4] and [i for i in lines if "val_loss" in lines[i]] == [2, 4]
    for i, r in lines.items():
        assert r["mlm_loss"] + r["sop_loss"] == pytest.approx(r["loss"], rel=1e-6), r
        assert 0.5 < r["sop_loss"] < 1.0 < r["mlm_loss"], r  # a binary head near chance, MLM over 512 pieces
        if "val_loss" in r:
            assert r["val_mlm_loss"] + r["val_sop_loss"] == pytest.approx(r["val_loss"], rel=1e-6), r
    print(json.dumps(lines[4]))


def test_bert_summary_compares_the_val_mlm_loss_with_the_unigram_entropy(bert_run):
    root, stdout = bert_run
    found = re.search(r"unigram entropy of the training data (\S+) \(nats/token\); val mlm_loss (\S+) is (\S+) "
                      r"(below|above) it", stdout)
    assert found, stdout
    entropy, mlm, gap = (float(found.group(k)) for k in (1, 2, 3))
    assert mlm == round(metrics(root / "run")[4]["val_mlm_loss"], 4)
    assert gap == pytest.approx(abs(mlm - entropy), abs=2e-4) and (found.group(4) == "below") == (mlm < entropy)


def test_train_iters_0_saves_the_untrained_model_and_a_run_continues_from_it(bert_run, tmp_path):
    done = pretrain(BERT + ["--train-iters", "0", "--save", "control"], tmp_path)
    assert re.search(r"done at iteration 0: val loss \S+ \(mlm_loss \S+, sop_loss \S+\)", done.stdout), done.stdout
    assert (tmp_path / "control" / "latest").read_text().strip() == "iter_0000000"
    assert (tmp_path / "control" / "metrics.jsonl").read_text() == ""
    pretrain(BERT + ["--train-iters", "2", "--load", "control", "--save", "continued"], tmp_path)
    # iterations 1-2 are in warmup, where the lr does not depend on --train-iters: the 4-iteration run's numbers
    whole, continued = metrics(bert_run[0] / "run"), metrics(tmp_path / "continued")
    fields = ("loss", "mlm_loss", "sop_loss", "lr", "grad_norm", "val_loss")
    assert sorted(continued) == [1, 2]
    assert [[continued[i].get(f) for f in fields] for i in (1, 2)] == [[whole[i].get(f) for f in fields]
                                                                        for i in (1, 2)]


def test_no_binary_head_trains_the_mlm_loss_alone_resumes_and_fine_tunes(tmp_path):
    flags = BERT + ["--bert-no-binary-head", "--mask-prob", "0.4", "--save-interval", "4", "--save", "run"]
    pretrain(flags + ["--train-iters", "4"], tmp_path)
    meta = json.loads((tmp_path / "run" / "iter_0000004" / "meta.json").read_text())
    assert meta["checkpoint"]["model"]["options"] == {"add_binary_head": False}
    assert (meta["args"]["bert_no_binary_head"], meta["args"]["mask_prob"]) == (True, 0.4)
    pretrain(["--load", "run", "--train-iters", "6"], tmp_path)  # its flags restored: the same head-less model
    lines = metrics(tmp_path / "run")
    assert sorted(lines) == [1, 2, 3, 4, 5, 6]
    for r in lines.values():  # the MLM loss is the whole loss: no sentence-order part, trained or evaluated
        assert r["mlm_loss"] == r["loss"] and not [k for k in r if "sop" in k or "nsp" in k], r
    tuned = run([sys.executable, str(ROOT / "finetune.py"), "--load", "run", "--task", "demo", "--epochs", "1",
                 "--seq-length", "32", "--global-batch-size", "32", "--log-dir", "tuned"], tmp_path)
    assert tuned.returncode == 0, tuned.stderr[-4000:]
    assert "head.pooler.dense.weight" in tuned.stderr  # never saved: the classifier's pooler starts fresh
    assert "accuracy" in (tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()[-1]


def test_a_model_folder_without_the_binary_head_pretrains_on_samples_without_the_sentence_task(tmp_path):
    """--load FOLDER --finetune of a masked LM saved without its binary head (as from-hf writes a BertForMaskedLM):
    its samples follow the model loaded, flag or not, and the run records the flag, which a resume restores."""
    from tpzoo.models import full_state_dict
    from tpzoo.models.pretrained import write_pretrained
    from tpzoo.parallel import init_mesh

    case = MASKED_LM_ONLY
    config = case.config(num_layers=2, hidden_size=32, num_attention_heads=4)
    started = not dist.is_initialized()
    try:
        write_pretrained(tmp_path / "folder", case.model, case.options, config,
                         full_state_dict(case.build(config, init_mesh())))
    finally:  # the one-rank group init_mesh starts here, in pytest's process: the next tests must find none
        if started:
            dist.destroy_process_group()
    pretrain(TINY + ["--load", "folder", "--finetune", "--train-iters", "2", "--save", "run"], tmp_path)
    meta = json.loads((tmp_path / "run" / "iter_0000002" / "meta.json").read_text())
    assert meta["checkpoint"]["model"]["options"] == case.options and meta["args"]["bert_no_binary_head"]
    for r in metrics(tmp_path / "run").values():  # the MLM loss alone: no sentence-order part
        assert r["mlm_loss"] == r["loss"] and not [k for k in r if "sop" in k or "nsp" in k], r
    pretrain(["--load", "run", "--train-iters", "3"], tmp_path)  # resumed as the model it holds


@pytest.mark.tier("unit")
def test_loss_names_come_from_the_model_family():
    masked, causal = MASKED_LM.model_class, CAUSAL_LM.model_class
    assert masked.loss_names(SimpleNamespace(binary_head="sop")) == {"labels": "mlm_loss",
                                                                     "next_sentence_label": "sop_loss"}
    assert masked.loss_names(SimpleNamespace(binary_head="nsp"))["next_sentence_label"] == "nsp_loss"
    assert masked.loss_names(SimpleNamespace(binary_head=None)) == {"labels": "mlm_loss"}
    assert causal.loss_names(SimpleNamespace()) == {}  # GPT logs its loss alone, as ``loss``
