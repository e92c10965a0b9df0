"""Checkpoints do not depend on context parallelism: one 8-rank spawn trains GPT at (tp, pp, dp, cp) = (2, 1, 2, 2)
with ZeRO-1 (its optimizer state sharded over dp x cp = 4 ranks), saving after step 3 of 5; resumed at cp 4 (dp 1)
and at cp 1 (dp 4), each holds the saved weights and optimizer state bit for bit and trains the next 2 steps to the
uninterrupted run's losses."""

from __future__ import annotations

from functools import partial

import background
import pytest
import torch
from cases import CaseLog, assert_case
from test_checkpoint import CAUSAL, CLIP, EPS, G, LR, SAVE_AT, STEPS, WD, assert_same_state, batch, gathered_state, \
    model_config

from tpzoo.checkpoint import load_checkpoint, save_checkpoint
from tpzoo.engine import Engine, EngineConfig
from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed

pytestmark = pytest.mark.tier("distributed")

SAVED_AT = (2, 1, 2, 2)  # (tp, pp, dp, cp)
RESUMED_AT = {"cp4": (2, 1, 1, 4), "cp1": (2, 1, 4, 1)}
NAMES = ["save-cp2", *(f"resume-{name}" for name in RESUMED_AT)]


def make_engine(shape: tuple[int, int, int, int], zero: bool, seed: int) -> Engine:
    tp, pp, dp, cp = shape
    mesh = init_mesh(tp=tp, pp=pp, dp=dp, cp=cp)
    manual_seed(seed, mesh)  # another seed on resume: only the loaded weights give the same losses
    config = model_config(CAUSAL)
    return Engine(partial(CAUSAL.build, config), config,
                  EngineConfig(micro_batch_size=G // (dp * pp), global_batch_size=G, lr=LR, weight_decay=WD,
                               adam_eps=EPS, clip_grad=CLIP, use_distributed_optimizer=zero,
                               **({"zero_stage": 1} if zero else {})),
                  ParallelPlan(mesh, kernels="torch"))


def train(engine: Engine, steps: range) -> list[float]:
    return [engine.train_step(batch(CAUSAL, step)).loss for step in steps]


def eight_ranks(root: str) -> CaseLog:
    log, ref = CaseLog(), {}
    with log.case("save-cp2"):
        engine = make_engine(SAVED_AT, True, 99)
        train(engine, range(SAVE_AT))
        save_checkpoint(root, SAVE_AT, engine, meta={})
        ref = dict(state=gathered_state(engine), losses=train(engine, range(SAVE_AT, STEPS)))
    for name, shape in RESUMED_AT.items():
        with log.case(f"resume-{name}"):
            engine = make_engine(shape, False, 7)
            assert load_checkpoint(root, engine)["iteration"] == SAVE_AT
            assert_same_state(engine, ref["state"], name)
            log.close(torch.tensor(train(engine, range(SAVE_AT, STEPS))), torch.tensor(ref["losses"]),
                      f"{name}: losses after resuming", "loss", 1e-5)
    return log


@background.fixture
def logs(tmp_path_factory) -> list[CaseLog]:
    return background.spawn(eight_ranks, 8, str(tmp_path_factory.mktemp("cp-checkpoints")), timeout=600)


@pytest.mark.parametrize("name", NAMES)
def test_context_parallel_checkpoint_resumes_at_another_cp(logs, name):
    assert_case(logs, name)
