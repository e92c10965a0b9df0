"""Checkpoints written by earlier tpzoos still load and resume: ``tests/fixtures/checkpoint_v1`` (before the
model families, issue #13) and ``checkpoint_v2`` (before the models became plain code with sharding plans
applied from outside, issue #24).

v1 holds a tiny GPT (2 layers) and a tiny BERT (1 layer), hidden 8, 4 heads, trained at tp 2; its meta.json
holds that commit's config layout (run options such as ``sequence_parallel`` inside the model config). v2
holds a Llama (2 layers, 2 kv groups; tp 2 x pp 2), a GPT (untied; tp 2 with sequence parallelism) and a BERT
(2 layers; tp 2 x pp 2 with sequence parallelism). Each was trained by ``pretrain.py`` on the demo corpus for 6
iterations, float32 without dropout, of which only the checkpoint of iteration 3 is kept, next to the run's
``metrics.jsonl`` (iterations 1..6); see each fixture's README.md for the commit and the commands.

- ``load_model`` at tp 1 and tp 2 rebuilds each model and reads every saved weight: the gathered
  weights equal the checkpoint's tensors bit for bit (read with DCP alone, no tpzoo), with no name
  left over on either side, and the logits at tp 1 and tp 2 agree.
- ``pretrain.py --load COPY --save DIR``, on one process (tp 1: a reshard of the tp 2 save), with no
  other flag, resumes at iteration 3 with the saving run's validation loss and logs iterations 4..6
  with its losses. The demo corpus is found again by itself (the checkpoint's recorded data flags
  are empty), so no data flag is given; the absolute paths meta.json records (tokenizer, data
  prefix) name the machine that wrote it and are not needed.
"""

from __future__ import annotations

import json
import re
import shutil
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from pretrain_helpers import metrics, pretrain, rel

from tpzoo.checkpoint import load_model
from tpzoo.models import full_state_dict
from tpzoo.parallel import init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")



FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# the saved runs (fixture/run) and the inputs their forward takes besides input_ids
BERT_INPUTS = ("token_type_ids", "attention_mask")
RUNS = {"checkpoint_v1/gpt": (), "checkpoint_v1/bert": BERT_INPUTS,
        "checkpoint_v2/llama": (), "checkpoint_v2/gpt": (), "checkpoint_v2/bert": BERT_INPUTS}
SAVED, ITERS, GLOBAL_BATCH = 3, 6, 8
TPS = (1, 2)
LOSS_TOL = 1e-6     # float32, same batches; measured: v1 identical (0.0) for every loss of both runs
LOGITS_TOL = 1e-5   # tp 2 sums the row-parallel products in another order than tp 1


def iteration_folder(run: str) -> Path:
    return FIXTURES / run / f"iter_{SAVED:07d}"


def saved_weights(run: str) -> dict[str, np.ndarray]:
    """The model tensors of the fixture's checkpoint, full (unsharded), read by DCP without tpzoo."""
    folder = iteration_folder(run)
    entries = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in entries.items()
             if k.startswith("model.")}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    return {k.removeprefix("model."): v.numpy() for k, v in state.items()}


def inputs(extras: tuple[str, ...], vocab_size: int) -> dict[str, torch.Tensor]:
    """Two sequences of 16 tokens; token types 0 then 1, the second sequence padded after 11 tokens."""
    g = torch.Generator().manual_seed(0)
    out = dict(input_ids=torch.randint(0, vocab_size, (2, 16), generator=g),
               token_type_ids=(torch.arange(16) >= 8).long().expand(2, 16).clone(),
               attention_mask=(torch.arange(16) < torch.tensor([[16], [11]])).long())
    return {k: v for k, v in out.items() if k == "input_ids" or k in extras}


def load_at_each_tp() -> dict[str, dict]:
    """On each of 2 ranks, per run: load_model at tp 1 and tp 2 -> {"weights tp=N": full state,
    "logits tp=N": logits} (numpy), or {"error": traceback} so that the other run is still checked."""
    out: dict[str, dict] = {}
    for run, extras in RUNS.items():
        vocab_size = json.loads((iteration_folder(run) / "meta.json").read_text())["tokenizer"]["vocab_size"]
        found: dict = {}
        try:
            for tp in TPS:
                mesh = init_mesh(tp=tp)
                model = load_model(FIXTURES / run, mesh).eval()
                found[f"weights tp={tp}"] = {k: v.numpy() for k, v in full_state_dict(model, mesh).items()}
                with torch.no_grad():
                    found[f"logits tp={tp}"] = model(**inputs(extras, vocab_size)).numpy()
        except Exception:  # noqa: BLE001 - reported by the test of this run
            found = {"error": traceback.format_exc()}
        out[run] = found
    return out


@pytest.fixture(scope="module")
def loaded() -> dict[str, dict]:
    return spawn(load_at_each_tp, 2, timeout=120)[0]


@pytest.mark.parametrize("run", RUNS)
def test_load_model_reads_every_saved_weight(loaded, run):
    found = loaded[run]
    assert "error" not in found, found.get("error")
    saved = saved_weights(run)
    for tp in TPS:
        weights = found[f"weights tp={tp}"]
        assert sorted(weights) == sorted(saved), f"tp={tp}: names differ: model only " \
            f"{sorted(set(weights) - set(saved))}, checkpoint only {sorted(set(saved) - set(weights))}"
        differ = [name for name in saved if not np.array_equal(weights[name], saved[name])]
        assert not differ, f"tp={tp}: weights differ from the checkpoint's: {differ}"


@pytest.mark.parametrize("run", RUNS)
def test_load_model_gives_the_same_logits_at_tp_1_and_2(loaded, run):
    found = loaded[run]
    assert "error" not in found, found.get("error")
    one, two = found["logits tp=1"], found["logits tp=2"]
    assert one.shape == two.shape and np.isfinite(one).all() and np.isfinite(two).all()
    err = float(np.abs(one - two).max() / np.abs(one).max())
    print(f"{run}: logits {one.shape}, tp 2 vs tp 1 relative difference {err:.1e}")
    assert err <= LOGITS_TOL


@pytest.mark.tier("journey")
@pytest.mark.parametrize("run", RUNS)
def test_resume_logs_the_saved_runs_losses(run, tmp_path):
    shutil.copytree(FIXTURES / run, tmp_path / run)
    done = pretrain(["--load", run, "--save", "resumed"], tmp_path)
    saved, resumed = metrics(FIXTURES / run), metrics(tmp_path / "resumed")
    found = re.search(rf"resumed from \S+ at iteration {SAVED} \(consumed samples {SAVED * GLOBAL_BATCH}\): "
                      rf"val loss (\S+)", done.stdout)
    assert found, done.stdout
    assert "change" not in done.stdout, done.stdout
    assert sorted(resumed) == list(range(SAVED + 1, ITERS + 1))
    keys = [k for k in saved[ITERS] if k.endswith("loss")]
    assert set(keys) <= set(resumed[ITERS]) and keys, (keys, resumed[ITERS])
    worst = max(rel(resumed[i][k], saved[i][k]) for i in resumed for k in keys if k in saved[i])
    val = rel(float(found.group(1)), saved[SAVED]["val_loss"])
    print(f"{run} resumed at tp 1: largest loss difference {worst:.1e} ({', '.join(keys)}), val loss after "
          f"loading {val:.1e}")
    assert worst <= LOSS_TOL and val <= 1e-6  # the val loss is printed with 6 decimals
    assert [resumed[i]["lr"] for i in resumed] == [saved[i]["lr"] for i in resumed]
