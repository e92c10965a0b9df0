"""HSDP (``init_mesh(dp_replicate=R)`` with ``ParallelPlan(fsdp=True)``; --num-distributed-optimizer-instances R
--use-torch-fsdp2): FSDP's shards over dp / R ranks, replicated over R groups of them.

One 4-rank spawn, each check a named case (``-k hsdp``): 5 steps equal the single-rank run within 1e-5 (losses,
parts, norms, final weights: ``test_engine``'s references and ``compare``) at (tp, pp, dp) = (1, 1, 4) (GPT), (2, 1, 2)
(Llama) and (1, 2, 2) (BERT, gpipe), R = 2; the replicas hold the same shards, each 1 / (dp / R) of the weights; a
checkpoint saved under HSDP loads into plain FSDP and into the plain engine at another mesh with the same weights.
pretrain.py with the flags logs the single-process losses.
"""

from __future__ import annotations

import tempfile

import background
import pytest
import torch
import torch.distributed as dist
from cases import CaseLog, assert_case
from pretrain_helpers import TINY, metrics, pretrain, rel
from test_engine import MESH_WEIGHT_TOL, PRETRAINING, compare, ref_key, refs, train

from tpzoo.checkpoint import load_checkpoint, save_checkpoint
from tpzoo.models import full_state_dict
from tpzoo.parallel import init_mesh
from tpzoo.parallel.fsdp import local

pytestmark = pytest.mark.tier("distributed")

NAME = PRETRAINING[0]
# (tp, pp, dp), family, schedule: dp alone, tp inside each replica, a pipeline over them
RUNS = [((1, 1, 4), NAME, "1f1b"), ((2, 1, 2), PRETRAINING[2], "1f1b"), ((1, 2, 2), PRETRAINING[1], "gpipe")]
RUN_NAMES = [f"hsdp-{name}-tp{tp}-pp{pp}-dp{dp}-{schedule}-r2" for (tp, pp, dp), name, schedule in RUNS]
CASE_NAMES = [*RUN_NAMES, "hsdp-replicas-hold-the-same-shards", "hsdp-checkpoint-loads-into-fsdp-and-plain"]


def same_over(group, tensors: list[torch.Tensor]) -> bool:
    """Whether every rank of ``group`` holds the same ``tensors`` as its first rank."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    first = flat.clone()
    dist.broadcast(first, dist.get_global_rank(group, 0), group=group)
    return torch.equal(flat, first)


def check_hsdp(refs: dict) -> CaseLog:
    log = CaseLog()
    for case, (shape, name, schedule) in zip(RUN_NAMES, RUNS):
        mesh = init_mesh(*shape, dp_replicate=2)
        with log.case(case):
            engine, results = train(name, mesh, schedule, fsdp=True)
            compare(engine, results, refs[ref_key(name, shape[0])], log, MESH_WEIGHT_TOL)
    mesh = init_mesh(1, 1, 4, dp_replicate=2)
    engine, _ = train(NAME, mesh, "1f1b", fsdp=True)
    with log.case(CASE_NAMES[3]):
        shards = [local(p.detach()) for p in engine.params]
        assert same_over(mesh.replicas[0], shards), "the replicas hold different shards"
        held = torch.tensor([sum(s.numel() for s in shards)])
        total = held.clone()
        dist.all_reduce(total, group=mesh.fsdp_group)
        assert total.item() == sum(p.numel() for p in engine.params) and held.item() <= 0.6 * total.item()
    with log.case(CASE_NAMES[4]):
        folder = [tempfile.mkdtemp(prefix="hsdp-")] if dist.get_rank() == 0 else [None]
        dist.broadcast_object_list(folder, src=0)
        saved = save_checkpoint(folder[0], 5, engine, meta={})
        want = full_state_dict(engine.chunks[0].model, mesh)
        for shape, fsdp in (((1, 1, 4), True), ((2, 1, 2), False)):
            other, _ = train(NAME, init_mesh(*shape), "1f1b", steps=0, fsdp=fsdp)
            load_checkpoint(saved, other)
            got = full_state_dict(other.chunks[0].model, other.mesh)
            for key, value in want.items():
                log.close(got[key], value, f"{key} at {shape}", "loaded", 0.0, scale=1e-12)
    return log


@background.fixture
def hsdp_logs(tmp_path_factory) -> list[CaseLog]:
    return background.spawn(check_hsdp, 4, refs(), timeout=900)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_engine_hsdp(hsdp_logs, name):
    assert_case(hsdp_logs, name)


@background.fixture
def hsdp_pretrain(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    flags = TINY + ["--train-iters", "4", "--eval-interval", "4"]
    pretrain(flags + ["--save", "one"], root)
    done = pretrain(flags + ["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "2", "--save", "hsdp"],
                    root, mesh=(1, 1, 4))
    return root, done.stdout


@pytest.mark.tier("journey")
def test_pretrain_hsdp_logs_the_single_process_losses(hsdp_pretrain):
    root, out = hsdp_pretrain
    assert "mesh      tp 1 x pp 1 x dp 4 = 4 ranks, HSDP (2 replicas), 1f1b schedule" in out, out[:2000]
    one, hsdp = metrics(root / "one"), metrics(root / "hsdp")
    assert sorted(one) == sorted(hsdp) == [1, 2, 3, 4]
    assert max(rel(hsdp[i][k], one[i][k]) for i in one for k in ("loss", "val_loss") if k in one[i]) <= 1e-5


@pytest.mark.tier("unit")
def test_hsdp_needs_fsdp():
    from tpzoo.training.parallel_config import ParallelConfig
    with pytest.raises(ValueError, match=r"--num-distributed-optimizer-instances 2: tpzoo replicates FSDP's shards "
                                         r"\(HSDP\) with --use-torch-fsdp2, at cp 1 and ep 1 only"):
        ParallelConfig(num_distributed_optimizer_instances=2)
