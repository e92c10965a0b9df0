"""ParallelPlan: the run options a model is handed, each checked with an error naming the value."""

from __future__ import annotations

import pytest

from tpzoo.parallel import ParallelPlan, as_plan, init_mesh

pytestmark = pytest.mark.tier("unit")




@pytest.mark.parametrize("changes, error, message", [
    (dict(attention_backend="flash"), ValueError,
     "ParallelPlan.attention_backend must be one of auto, fused-softmax, sdpa; got 'flash'"),
    (dict(kernels="cuda"), ValueError, "ParallelPlan.kernels must be one of None, auto, triton, torch; got 'cuda'"),
    (dict(sequence_parallel=1), TypeError, "ParallelPlan.sequence_parallel must be True or False, got 1"),
    (dict(seed=-1), ValueError, "ParallelPlan.seed must be an int >= 0, got -1"),
], ids=["attention-backend", "kernels", "sequence-parallel", "seed"])
def test_plan_rejects_bad_options_naming_them(changes, error, message):
    with pytest.raises(error, match=message):
        ParallelPlan(init_mesh(), **changes)


def test_plan_from_a_mesh_or_none_takes_default_options():
    mesh = init_mesh()
    plan = as_plan(mesh, sequence_parallel=True)
    assert plan.mesh is mesh and plan.sequence_parallel and plan.options()["seed"] == 1234
    assert as_plan(None).mesh is mesh and as_plan(plan) is plan
    with pytest.raises(TypeError, match="expected a ParallelPlan, a ParallelMesh or None, got str"):
        as_plan("tp=2")
    with pytest.raises(TypeError, match="ParallelPlan.mesh must be a ParallelMesh, got NoneType"):
        ParallelPlan(None)
