"""The mixture-of-experts family in the engine (issue 28, its first meshes: expert parallelism is not in the engine
yet): Mixtral's tiny case with its router's per-sequence losses in the training loss (``families.MOE_AUX_LM``) on 4
gloo ranks, each mesh against the single-rank run of ``test_engine`` (5 AdamW steps: losses, gradient norms and
every final weight within 1e-5): data parallelism with ZeRO-2 or FSDP and recompute (the router's losses counted once
over the dp ranks and micro-batches), tensor parallelism with sequence parallelism (the other tp ranks' tokens of each
sequence added), pipelines (each stage's layers adding theirs). Each run is its own case (``-k 'tp2'``)."""

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


def check(refs: dict) -> CaseLog:
    log = CaseLog()
    for (tp, pp, dp, *_), (schedule, on, fsdp) in RUNS.items():
        run_case(log, refs, init_mesh(tp=tp, pp=pp, dp=dp), NAME, schedule, options_of(on, tp, fsdp))
    return log


@pytest.fixture(scope="module")
def logs() -> list[CaseLog]:
    return spawn(check, 4, spawn(references, 1)[0], timeout=900)


def test_every_mesh_has_a_case(logs):
    assert logs[0].ran == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_moe_engine_equals_single_rank(logs, name):
    assert_case(logs, name)
