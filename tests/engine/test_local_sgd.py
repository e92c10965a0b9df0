"""Local SGD over dp (``EngineConfig.local_sgd_steps``, ``tpzoo.engine.local_sgd``; --local-sgd-steps).

One 4-rank spawn, each check a named case (``-k local-sgd``): with H = 1, an outer lr of 1 and SGD (momentum, L2
weight decay, no clipping) the losses and final weights equal plain dp's within 1e-5, at dp 4 and at tp 2 x dp 2;
with H = 8 the bytes dp all-reduces per step are 8 times fewer (counted: the gradient buckets of plain dp, the outer
steps' weights); between outer steps the replicas differ, after one (or a save, which takes it early) they agree;
FSDP is refused with one line. pretrain.py at dp 2 with --local-sgd-steps 8: the loss falls on the demo corpus.
"""

from __future__ import annotations

import background
import pytest
import torch
import torch.distributed as dist
from cases import CaseLog, assert_case
from families import CASES
from pretrain_helpers import TINY, metrics, pretrain
from test_engine import G, config_of, global_batch

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.train_step import Engine
from tpzoo.models import full_state_dict
from tpzoo.parallel import ParallelPlan, init_mesh

pytestmark = pytest.mark.tier("distributed")

NAME, TOL, STEPS = "gpt", 1e-5, 5
SGD = dict(optimizer="sgd", sgd_momentum=0.9, weight_decay=0.01, clip_grad=0.0, lr=0.05)
CASE_NAMES = ["local-sgd-h1-equals-plain-dp-dp4", "local-sgd-h1-equals-plain-dp-tp2-dp2",
              "local-sgd-h8-all-reduces-8x-fewer-bytes", "local-sgd-replicas-agree-after-outer-steps-and-saves",
              "local-sgd-refuses-fsdp"]


def engine(mesh, fsdp: bool = False, **options) -> Engine:
    config = config_of(NAME, mesh.tp_size)
    return Engine(lambda plan, **stage: CASES[NAME].build(config, plan, **stage), config,
                  EngineConfig(micro_batch_size=G // mesh.dp_size, global_batch_size=G, **{**SGD, **options}),
                  ParallelPlan(mesh, kernels="torch", fsdp=fsdp))


def spread(engine: Engine) -> float:
    """The largest difference of a main weight between this rank's dp replica and dp rank 0's."""
    worst = torch.zeros(())
    for p in engine.main.params:
        first = p.detach().clone()
        dist.broadcast(first, dist.get_global_rank(engine.mesh.dp_group, 0), group=engine.mesh.dp_group)
        worst = torch.maximum(worst, (p.detach() - first).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def check_local_sgd() -> CaseLog:
    log = CaseLog()
    for case, shape in zip(CASE_NAMES[:2], [(1, 1, 4), (2, 1, 2)]):
        mesh = init_mesh(*shape)
        with log.case(case):
            runs = [engine(mesh, **options) for options in ({}, dict(local_sgd_steps=1, outer_lr=1.0))]
            results = [[e.train_step(global_batch(NAME, step)) for step in range(STEPS)] for e in runs]
            for step, (plain, local) in enumerate(zip(*results)):
                log.close(torch.tensor(local.loss), torch.tensor(plain.loss), f"step {step} loss", "loss", TOL)
            states = [full_state_dict(e.chunks[0].model, mesh) for e in runs]
            for key, want in states[0].items():
                log.close(states[1][key], want, key, "weights", TOL, scale=1e-12)
    mesh = init_mesh(1, 1, 4)
    with log.case(CASE_NAMES[2]):
        plain, local = engine(mesh), engine(mesh, local_sgd_steps=8)
        for step in range(16):
            plain.train_step(global_batch(NAME, step))
            local.train_step(global_batch(NAME, step))
        per_step = plain.reducer.reduced_bytes / 16, local.local_sgd.reduced_bytes / 16
        print(f"bytes all-reduced per step over dp: plain {per_step[0]:,.0f}, local SGD (H 8) {per_step[1]:,.0f}")
        assert local.reducer is None and per_step[0] == 8 * per_step[1] > 0, per_step
    with log.case(CASE_NAMES[3]):
        local = engine(mesh, local_sgd_steps=4)
        for step in range(3):
            local.train_step(global_batch(NAME, step))
        assert spread(local) > 1e-4, "the replicas should move apart between outer steps"
        local.train_step(global_batch(NAME, 3))
        assert spread(local) == 0.0 and local.local_sgd.updates == 0
        local.train_step(global_batch(NAME, 4))
        assert spread(local) > 0
        local.sync_replicas()  # what save_checkpoint does first
        assert spread(local) == 0.0
    with log.case(CASE_NAMES[4]):
        try:
            engine(mesh, fsdp=True, local_sgd_steps=2)
        except ValueError as e:
            assert str(e) == ("--local-sgd-steps 2: FSDP shards each replica's weights over dp; drop "
                              "--use-torch-fsdp2 or --local-sgd-steps"), str(e)
        else:
            raise AssertionError("FSDP with local SGD was not refused")
    return log


@background.fixture
def local_sgd_logs(tmp_path_factory) -> list[CaseLog]:
    return background.spawn(check_local_sgd, 4, timeout=600)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_local_sgd(local_sgd_logs, name):
    assert_case(local_sgd_logs, name)


@background.fixture
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("local-sgd")
    flags = TINY + "--train-iters 40 --eval-interval 40 --local-sgd-steps 8 --save-interval 8 --save run".split()
    return root, pretrain(flags, root, mesh=(1, 1, 2)).stdout


@pytest.mark.tier("journey")
def test_pretrain_with_local_sgd_learns_the_demo_corpus(demo):
    root, out = demo
    assert "mesh      tp 1 x pp 1 x dp 2 = 2 ranks, local SGD (H 8), 1f1b schedule" in out, out[:2000]
    logged = metrics(root / "run")
    assert sorted(logged) == list(range(1, 41)), out[-2000:]
    first, last = logged[1]["loss"], logged[40]["loss"]
    print(f"local SGD (H 8, dp 2): loss {first:.4f} -> {last:.4f}")
    assert last < first - 0.5, (first, last)


@pytest.mark.tier("unit")
def test_local_sgd_refusals():
    with pytest.raises(ValueError, match="EngineConfig.local_sgd_steps=2: each dp replica keeps all its weights"):
        EngineConfig(local_sgd_steps=2, use_distributed_optimizer=True)
    from tpzoo.run_options import local_sgd_problem
    assert local_sgd_problem(None, True, 2, 2) is None
    assert local_sgd_problem(4, False, 1, 2) == ("--local-sgd-steps 4: the cp 2 ranks of a sequence are parts of one "
                                                 "replica; drop --context-parallel-size or --local-sgd-steps")
