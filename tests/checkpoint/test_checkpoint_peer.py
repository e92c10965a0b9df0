"""A replica group's state handed to a peer (``tpzoo.checkpoint.peer``, per-step fault tolerance's healing) on every
layout a group may have: one 2-rank spawn, an engine trained 3 steps hands ``peer_state`` to an engine of other
weights on the same ranks (rank r to rank r, as torchft moves it); the receiver then holds the same main weights,
model weights and optimizer state bit for bit, and the next step gives both the same loss and the same state.
Cases: tp 2 (fp32), ZeRO-1 and ZeRO-2 over dp 2, fp16 at tp 2 (the loss scaler's state), FSDP over dp 2 (DTensor
shards and their optimizer state), and a peer of another mesh refused. And a step that a replica group failed in
(torchft's commit says no): nothing changes, and the step taken again updates as usual."""

from __future__ import annotations

import functools

import background
import pytest
from cases import CaseLog, assert_case
from test_checkpoint import CAUSAL, CLIP, EPS, G, LR, MASKED, SAVE_AT, WD, assert_same_state, batch, gathered_state
from test_checkpoint import model_config

from tpzoo.checkpoint.peer import load_peer_state, peer_state
from tpzoo.engine import Engine, EngineConfig
from tpzoo.engine.fault_tolerance import ReplicaGroups
from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed

pytestmark = pytest.mark.tier("distributed")

# name: (model, precision, (tp, dp), ZeRO stage or None, FSDP)
CASES = {"tp2-fp32": (CAUSAL, "fp32", (2, 1), None, False), "zero1-dp2": (CAUSAL, "fp32", (1, 2), 1, False),
         "zero2-dp2": (CAUSAL, "bf16", (1, 2), 2, False), "tp2-fp16": (MASKED, "fp16", (2, 1), None, False),
         "fsdp-dp2": (CAUSAL, "fp32", (1, 2), None, True)}
NAMES = [*CASES, "another-mesh-refused", "uncommitted-step"]


class OneGroup(ReplicaGroups):
    """A single replica group whose commits say what ``commits`` lists (torchft's manager not needed)."""

    def __init__(self, commits: list[bool]) -> None:
        super().__init__(manager=None, index=0, count=1)
        self.commits = commits

    @property
    def live(self) -> int:
        return 1

    def all_reduce(self, tensors) -> None:
        pass

    def commit(self) -> bool:
        return self.commits.pop(0)


def make_engine(name: str, seed: int, replicas: ReplicaGroups | None = None) -> Engine:
    case, precision, (tp, dp), zero, fsdp = CASES[name]
    mesh = init_mesh(tp=tp, dp=dp)
    manual_seed(seed, mesh)
    config = model_config(case)
    return Engine(functools.partial(case.build, config), config,
                  EngineConfig(micro_batch_size=G // dp, global_batch_size=G, lr=LR, weight_decay=WD, adam_eps=EPS,
                               clip_grad=CLIP, precision=precision, initial_loss_scale=2.0**10,
                               use_distributed_optimizer=zero is not None, zero_stage=zero),
                  ParallelPlan(mesh, kernels="torch", fsdp=fsdp), replicas)


def two_ranks() -> CaseLog:
    log = CaseLog()
    for name, (case, *_) in CASES.items():
        with log.case(name):
            live, back = make_engine(name, 7), make_engine(name, 99)
            for step in range(SAVE_AT):
                live.train_step(batch(case, step))
            load_peer_state(back, peer_state(live))
            assert_same_state(back, gathered_state(live), f"{name}: received")
            if live.scaler is not None:
                assert back.loss_scale == live.loss_scale and back.scaler.state_dict() == live.scaler.state_dict()
            losses = [e.train_step(batch(case, SAVE_AT)).loss for e in (live, back)]
            assert losses[0] == losses[1], f"{name}: losses after healing {losses}"
            assert_same_state(back, gathered_state(live), f"{name}: a step after")
    with log.case("another-mesh-refused"):
        state = peer_state(make_engine("tp2-fp32", 7))
        with pytest.raises(ValueError, match=r"a peer replica group sent a weight of shape \[\d+(, \d+)*\] where "
                                             r"this rank holds \[\d+(, \d+)*\]: the groups run other meshes"):
            load_peer_state(make_engine("fsdp-dp2", 7), state)
    with log.case("uncommitted-step"):
        plain, ft = make_engine("zero1-dp2", 7), make_engine("zero1-dp2", 7, OneGroup([False, True]))
        before = gathered_state(ft)
        failed = ft.train_step(batch(CAUSAL, 0))
        assert not failed.committed and failed.live_replicas == 1
        assert_same_state(ft, before, "uncommitted-step: after the failed step")
        assert ft.train_step(batch(CAUSAL, 0)).loss == plain.train_step(batch(CAUSAL, 0)).loss
        assert_same_state(ft, gathered_state(plain), "uncommitted-step: the step taken again")
    return log


@background.fixture
def logs(tmp_path_factory) -> list[CaseLog]:
    return background.spawn(two_ranks, 2, timeout=600)


@pytest.mark.parametrize("name", NAMES)
def test_peer_state(logs, name):
    assert_case(logs, name)
