"""A mixture-of-experts family through the scripts (``families.MOE_LM``, Mixtral), with Megatron-LM's MoE flags:
``pretrain.py --model mixtral --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.01
--moe-z-loss-coeff 0.001`` trains on the demo corpus on one process and on 2 ranks at tp 2 with sequence
parallelism, logging the same losses and router losses (counted once a sequence on either mesh); the loss falls,
the checkpoint records the experts, and ``python -m tpzoo.generate`` continues a prompt from it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import background
import pytest
from families import MOE_LM
from pretrain_helpers import TINY, metrics, pretrain, rel, run

pytestmark = pytest.mark.tier("journey")

ITERS = 20
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001"]
FLAGS = TINY + ["--model", MOE_LM.family, "--num-query-groups", "2", *MOE, "--train-iters", str(ITERS),
                "--eval-interval", "0"]
MESHES = {"one": ((1, 1, 1), []), "tp2-sp": ((2, 1, 1), ["--sequence-parallel"])}


@background.fixture
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    for name, (mesh, extra) in MESHES.items():
        pretrain(FLAGS + extra + ["--save", name, "--log-dir", name], root, mesh)
    return root


def test_the_loss_falls_the_same_on_both_meshes_and_the_checkpoint_records_the_experts(runs):
    one, split = (metrics(runs / name) for name in MESHES)
    print("losses:", [round(one[i]["loss"], 4) for i in sorted(one)])
    assert sorted(one) == sorted(split) == list(range(1, ITERS + 1))
    assert max(rel(split[i]["loss"], one[i]["loss"]) for i in one) < 1e-5, [(one[i]["loss"], split[i]["loss"])
                                                                           for i in one]
    assert one[ITERS]["loss"] < one[1]["loss"] - 0.3, (one[1], one[ITERS])
    for key in ("load_balancing_loss", "z_loss"):  # logged every iteration, the same on both meshes
        assert max(rel(split[i][key], one[i][key]) for i in one) < 1e-5, key
    record = json.loads((runs / "tp2-sp" / f"iter_{ITERS:07d}" / "meta.json").read_text())["checkpoint"]
    config = record["model"]["config"]
    assert record["model"]["class"] == MOE_LM.model and record["mesh"]["tp"] == 2
    assert (config["num_experts"], config["moe_router_topk"], config["moe_ffn_hidden_size"],
            config["moe_aux_loss_coeff"], config["moe_z_loss_coeff"]) == (4, 2, 48, 0.01, 0.001)


def test_generate_continues_a_prompt_from_the_checkpoint(runs):
    done = run([sys.executable, "-m", "tpzoo.generate", "--load", "one", "--prompt", "the small dog",
                "--max-new-tokens", "4"], runs)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("the small dog") and len(done.stdout.strip()) > len("the small dog"), done.stdout
