"""The mixture-of-experts family in the engine (issue 28, its first meshes: expert parallelism is not in the engine
yet): Mixtral's tiny case with its router's per-sequence losses in the training loss (``families.MOE_AUX_LM``) on 4
gloo ranks, each mesh against the single-rank run of ``test_engine`` (5 AdamW steps: losses, gradient norms and
every final weight within 1e-5): data parallelism with ZeRO-2 or FSDP and recompute (the router's losses counted once
over the dp ranks and micro-batches), tensor parallelism with sequence parallelism (the other tp ranks' tokens of each
sequence added), pipelines (each stage's layers adding theirs); the router losses each step logs are the same on
every mesh. Each run is its own case (``-k 'tp2'``)."""

from __future__ import annotations

import pytest
from cases import CaseLog, assert_case
from families import MOE_AUX_LM
from test_engine import options_of, reference, ref_key, run_case, run_name

from tpzoo.parallel import init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")

NAME = MOE_AUX_LM.name
# (tp, pp, dp) -> (schedule, ZeRO-2 / recompute / sequence parallelism on, FSDP in place of ZeRO-2)
RUNS = {(1, 1, 4): ("1f1b", True, False), (2, 1, 2): ("1f1b", True, False), (1, 2, 2): ("1f1b", False, False),
        (2, 2, 1): ("interleaved-1f1b", True, False), (4, 1, 1): ("1f1b", False, False),
        (2, 1, 2, "fsdp"): ("1f1b", True, True)}
NAMES = [run_name(NAME, *mesh[:3], schedule, options_of(on, mesh[0], fsdp))
         for mesh, (schedule, on, fsdp) in RUNS.items()]


def references() -> dict:
    return {ref_key(NAME, tp): reference(NAME, tp) for tp in sorted({mesh[0] for mesh in RUNS})}


def check(refs: dict) -> tuple[CaseLog, dict[str, list[dict[str, float]]]]:
    """Each run's case, and the router losses its steps logged (``StepResult.router_losses``)."""
    log, router = CaseLog(), {}
    for (tp, pp, dp, *_), (schedule, on, fsdp) in RUNS.items():
        name = run_name(NAME, tp, pp, dp, schedule, options_of(on, tp, fsdp))
        run_case(log, refs, init_mesh(tp=tp, pp=pp, dp=dp), NAME, schedule, options_of(on, tp, fsdp),
                 lambda engine, results, name=name: router.update({name: [r.router_losses for r in results]}))
    return log, router


@pytest.fixture(scope="module")
def ranks() -> list[tuple[CaseLog, dict]]:
    return spawn(check, 4, spawn(references, 1)[0], timeout=900)


@pytest.fixture(scope="module")
def logs(ranks) -> list[CaseLog]:
    return [log for log, _ in ranks]


def test_every_mesh_has_a_case(logs):
    assert logs[0].ran == NAMES


def test_every_mesh_logs_the_same_router_losses(ranks):
    """The load balance and z-loss per sequence and layer of each step: the same on every mesh and rank of a model
    (the kv heads of ``test_engine.config_of`` follow tp: one model at tp 1 and 2, another at tp 4), a balance near 1
    (its floor for uniform routing) and a positive z-loss."""
    first = {}
    for mesh, name in zip(RUNS, NAMES):
        first.setdefault(ref_key(NAME, mesh[0]), ranks[0][1][name])
    for steps in first.values():
        assert len(steps) == 5 and all(set(step) == {"load_balancing_loss", "z_loss"} for step in steps), steps
        assert all(0.9 < step["load_balancing_loss"] < 2.0 and step["z_loss"] > 0 for step in steps), steps
    for _, router in ranks:
        for mesh, name in zip(RUNS, NAMES):
            for step, want in zip(router[name], first[ref_key(NAME, mesh[0])]):
                assert all(abs(step[k] - v) <= 1e-5 * abs(v) for k, v in want.items()), (name, step, want)


@pytest.mark.parametrize("name", NAMES)
def test_moe_engine_equals_single_rank(logs, name):
    assert_case(logs, name)
