"""A mixture-of-experts family through the scripts (``families.MOE_LM``, Mixtral), with Megatron-LM's MoE flags:
``pretrain.py --model mixtral --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.01
--moe-z-loss-coeff 0.001`` trains on the demo corpus on one process, on 2 ranks at tp 2 with sequence parallelism
and on 2 ranks at dp 2 with ``--expert-model-parallel-size 2`` (2 of the 4 experts a rank; and under FSDP, each rank's
experts sharded over their single edp rank), logging the same losses
and router losses (counted once a sequence on every mesh); with Megatron-LM's other MoE flags (``OPTIONS``: sigmoid
scores, the balance per micro-batch, a capacity factor, the grouped multiply, the all-to-all dispatcher) the same
losses on one process and at ep 2, other than without them; the loss falls, the checkpoints record the experts (the
ep one all 4 of them), and ``python -m tpzoo.generate`` continues a prompt from the ep checkpoint in one process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import background
import pytest
from doc_helpers import ROOT, commands, run_as_needed
from families import MOE_LM
from pretrain_helpers import TINY, metrics, pretrain, rel, run

pytestmark = pytest.mark.tier("journey")

ITERS = 20
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001"]
FLAGS = TINY + ["--model", MOE_LM.family, "--num-query-groups", "2", *MOE, "--train-iters", str(ITERS),
                "--eval-interval", "0"]
OPTIONS = ["--moe-router-score-function", "sigmoid", "--moe-router-load-balancing-type", "aux_loss",
           "--moe-expert-capacity-factor", "1.0", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"]
MESHES = {"one": ((1, 1, 1), []), "tp2-sp": ((2, 1, 1), ["--sequence-parallel"]),
          "dp2-ep2": ((1, 1, 2), ["--expert-model-parallel-size", "2"]),
          "dp2-ep2-fsdp": ((1, 1, 2), ["--expert-model-parallel-size", "2", "--use-torch-fsdp2"])}
OPTION_MESHES = {"options-one": ((1, 1, 1), OPTIONS), "options-dp2-ep2": ((1, 1, 2), [*OPTIONS, "--ep", "2"])}


@background.fixture
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    for name, (mesh, extra) in {**MESHES, **OPTION_MESHES}.items():
        pretrain(FLAGS + extra + ["--save", name, "--log-dir", name], root, mesh)
    return root


def test_the_loss_falls_the_same_on_every_mesh_and_the_checkpoints_record_the_experts(runs):
    one, *others = (metrics(runs / name) for name in MESHES)
    print("losses:", [round(one[i]["loss"], 4) for i in sorted(one)])
    for name, split in zip(list(MESHES)[1:], others):
        assert sorted(one) == sorted(split) == list(range(1, ITERS + 1)), name
        assert max(rel(split[i]["loss"], one[i]["loss"]) for i in one) < 1e-5, (name, [
            (one[i]["loss"], split[i]["loss"]) for i in one])
        for key in ("load_balancing_loss", "z_loss"):  # logged every iteration, the same on every mesh
            assert max(rel(split[i][key], one[i][key]) for i in one) < 1e-5, (name, key)
    assert one[ITERS]["loss"] < one[1]["loss"] - 0.3, (one[1], one[ITERS])
    for name, mesh in (("tp2-sp", {"pp": 1, "dp": 1, "tp": 2}), ("dp2-ep2", {"pp": 1, "dp": 2, "tp": 1, "ep": 2})):
        record = json.loads((runs / name / f"iter_{ITERS:07d}" / "meta.json").read_text())["checkpoint"]
        config = record["model"]["config"]
        assert record["model"]["class"] == MOE_LM.model and record["mesh"] == mesh, record["mesh"]
        assert (config["num_experts"], config["moe_router_topk"], config["moe_ffn_hidden_size"],
                config["moe_aux_loss_coeff"], config["moe_z_loss_coeff"]) == (4, 2, 48, 0.01, 0.001)


def test_the_options_train_the_same_on_one_process_and_at_ep_2(runs):
    one, split, plain = (metrics(runs / name) for name in (*OPTION_MESHES, "one"))
    assert sorted(one) == sorted(split) == list(range(1, ITERS + 1))
    for key in ("loss", "load_balancing_loss", "z_loss"):
        assert max(rel(split[i][key], one[i][key]) for i in one) < 1e-5, (key, [(one[i][key], split[i][key])
                                                                               for i in one])
    assert max(rel(one[i]["loss"], plain[i]["loss"]) for i in one) > 1e-4  # the options change the math (7.6e-4)
    assert one[ITERS]["loss"] < one[1]["loss"] - 0.3, (one[1], one[ITERS])
    config = json.loads((runs / "options-dp2-ep2" / f"iter_{ITERS:07d}" / "meta.json").read_text())["checkpoint"][
        "model"]["config"]
    assert (config["moe_router_score_function"], config["moe_router_load_balancing_type"],
            config["moe_expert_capacity_factor"]) == ("sigmoid", "aux_loss", 1.0)


def test_generate_continues_a_prompt_from_the_expert_parallel_checkpoint(runs):
    done = run([sys.executable, "-m", "tpzoo.generate", "--load", "dp2-ep2", "--prompt", "the small dog",
                "--max-new-tokens", "4"], runs)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("the small dog") and len(done.stdout.strip()) > len("the small dog"), done.stdout


def test_the_docs_commands_train_at_ep_2_and_plot_the_expert_load(tmp_path):
    """docs/moe.md's commands run: 2 ranks at --expert-model-parallel-size 2, the loss falls, the router losses and
    each layer's tokens per expert are logged (4 layers of 4 experts, every layer's adding up to the same slots),
    and the plot is drawn."""
    (tmp_path / "pretrain.py").symlink_to(ROOT / "pretrain.py")
    run_as_needed(commands("moe.md"), tmp_path)
    logged = metrics(tmp_path / "mixtral-ep2")
    first, last = logged[min(logged)], logged[max(logged)]
    assert max(logged) == 20 and last["loss"] < first["loss"], (first, last)
    assert {"load_balancing_loss", "z_loss"} <= set(last), last
    for line in logged.values():
        table = line["tokens_per_expert"]
        assert len(table) == 4 and {len(row) for row in table} == {4} and len({sum(row) for row in table}) == 1, line
    assert (tmp_path / "mixtral-ep2.png").stat().st_size > 10_000
