"""ZeRO-2 in the engine (``EngineConfig.zero_stage=2``, what ``use_distributed_optimizer`` now means):
gradients reduce-scattered over dp to the rank owning each parameter, which alone keeps them.

One 4-rank spawn, each check a named case (``pytest -k zero2``): at dp 4, 5 steps equal the single-rank
run within 1e-5 (``test_engine``'s machinery and references; its matrix runs ZeRO-2 on every mesh, with
the tied embedding summed over first+last stage, sequence parallelism's sums over tp and the zero-bubble
schedule's weight gradients, in the same 5 buckets); ZeRO-1
(``zero_stage=1``, the all-reduce) still does; after a step each rank holds the main gradients of the
parameters it owns and no others, all of them over dp once (~1/dp per rank, against ZeRO-1's all),
measured in the same spawn; the buckets start during backward, the reduce-scatters overlapping it;
an fp16 overflow on a rank that does not own the parameter reaches its owner and skips the step
everywhere.
"""

from __future__ import annotations

import background
import pytest
import torch
import torch.distributed as dist
from cases import CaseLog, assert_case
from test_engine import BUCKET_MB, PRETRAINING, compare, global_batch, ref_key, refs, train

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.data_parallel import gradient_bytes
from tpzoo.engine.mixed_precision import owners
from tpzoo.parallel import init_mesh
from tpzoo.parallel.param_facts import mark

pytestmark = pytest.mark.tier("unit")



FP16_TOL = 1e-2   # vs the float32 losses (test_engine_precision: fp16 measured 2.2e-3, one update behind)
# (tp, pp, dp), schedule, options (test_engine's matrix covers the other meshes, families and schedules)
RUNS = [((1, 1, 4), "1f1b", {})]


def run_name(name: str, mesh: tuple[int, int, int], schedule: str, options: dict, stage: int = 2) -> str:
    tp, pp, dp = mesh
    return f"zero{stage}-{name}-tp{tp}-pp{pp}-dp{dp}-{schedule}" + ("-sp" if options else "")


CASE_NAMES = [*(run_name(name, *run) for name, run in zip(PRETRAINING, RUNS)),
              run_name(PRETRAINING[0], *RUNS[0], stage=1), "zero2-holds-1/dp-of-zero1-grads",
              "zero2-fp16-overflow-reaches-owner-skips-everywhere"]


def holds_owned_grads(engine) -> None:
    """Each main parameter has a gradient iff this dp rank owns it."""
    rank = engine.mesh.dp_rank
    wrong = [i for i, (p, o) in enumerate(zip(engine.main.params, engine.main.owner))
             if (p.grad is not None) != (o == rank)]
    assert not wrong, f"dp rank {rank}: main parameters {wrong} hold a gradient they do not own, or lack their own"


def check_zero2(refs: dict) -> tuple[CaseLog, dict]:
    """The cases of CASE_NAMES on 4 ranks; also the main-gradient bytes per rank (ZeRO-1, ZeRO-2 largest and
    summed over dp) on (1, 1, 4)."""
    log, held = CaseLog(), {}
    for name, (shape, schedule, options) in zip(PRETRAINING, RUNS):
        mesh = init_mesh(*shape)
        with log.case(run_name(name, shape, schedule, options)):
            engine, results = train(name, mesh, schedule, use_distributed_optimizer=True, bucket_mb=BUCKET_MB,
                                    **options)
            compare(engine, results, refs[ref_key(name, shape[0])], log)
            assert engine.config.zero_stage == 2 and engine.reducer.sharded and len(engine.reducer.buckets) > 1
            holds_owned_grads(engine)
            if "zero-bubble" not in schedule:
                assert engine.reducer.overlapped == len(engine.reducer.buckets), "no overlap with backward"
            if shape == RUNS[0][0]:
                held[2] = gradient_bytes(engine.main.params)
    name, (shape, schedule, options) = PRETRAINING[0], RUNS[0]
    mesh = init_mesh(*shape)
    with log.case(run_name(name, shape, schedule, options, stage=1)):
        engine, results = train(name, mesh, schedule, use_distributed_optimizer=True, zero_stage=1,
                                bucket_mb=BUCKET_MB)
        compare(engine, results, refs[ref_key(name, 1)], log)
        assert not engine.reducer.sharded and all(p.grad is not None for p in engine.main.params)
        held[1] = gradient_bytes(engine.main.params)
        held["largest"] = max(p.numel() * 4 for p in engine.main.params)
    with log.case("zero2-holds-1/dp-of-zero1-grads"):
        sums = torch.tensor([held[2], held[2]])
        dist.all_reduce(sums[:1], group=mesh.dp_group)
        dist.all_reduce(sums[1:], op=dist.ReduceOp.MAX, group=mesh.dp_group)
        held["sum"], held["max"] = sums.tolist()
        assert held["sum"] == held[1], f"ZeRO-2's gradients over dp {held['sum']} B != ZeRO-1's {held[1]} B per rank"
        dp = mesh.dp_size
        assert held["max"] <= held[1] / dp + held["largest"], \
            f"a rank holds {held['max']} B of {held[1]} B: more than 1/{dp} plus one parameter"
    with log.case("zero2-fp16-overflow-reaches-owner-skips-everywhere"):
        mesh = init_mesh(*RUNS[0][0])
        engine, _ = train(name, mesh, "1f1b", steps=0, precision="fp16", use_distributed_optimizer=True,
                          bucket_mb=BUCKET_MB)
        victim = 0  # a parameter dp rank 3 does not own: its inf travels in the reduce-scatter
        while engine.main.owner[victim] == 3:
            victim += 1
        hook = engine.params[victim].register_hook(lambda g: g * float("inf")) if mesh.dp_rank == 3 else None
        scale, before = engine.loss_scale, [p.detach().clone() for p in engine.params]
        first = engine.train_step(global_batch(name, 0))
        if hook is not None:
            hook.remove()
        assert first.skipped and engine.loss_scale == scale / 2, f"rank {dist.get_rank()} did not skip the overflow"
        assert all(torch.equal(p, b) for p, b in zip(engine.params, before)), "a skipped step changed weights"
        for step in range(1, 4):
            r = engine.train_step(global_batch(name, step))
            assert not r.skipped
            log.close(torch.tensor(r.loss), torch.tensor(refs[ref_key(name, 1)][0][step]), f"fp16 step {step} loss",
                      "fp16", FP16_TOL)
        holds_owned_grads(engine)
    return log, held


@background.fixture
def zero2_logs(tmp_path_factory) -> list[tuple[CaseLog, dict]]:
    return background.spawn(check_zero2, 4, refs(), timeout=900)


@pytest.mark.tier("distributed")
@pytest.mark.parametrize("name", CASE_NAMES)
def test_engine_zero2(zero2_logs, name):
    if name == "zero2-holds-1/dp-of-zero1-grads":
        print("main-gradient bytes per rank at dp=4 (ZeRO-1; ZeRO-2 largest, summed over dp):",
              {k: zero2_logs[0][1][k] for k in (1, "max", "sum")})
    assert_case([log for log, _ in zero2_logs], name)


def test_owners_pin_the_tied_embedding_to_dp_rank_0():
    """Both copies of the tied embedding (first and last stage) must have one owner, whatever else the
    stages hold: by size alone this stage's small tied copy would go to dp rank 2."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (8, 9, 2, 7)]
    mark(params[2], pp_tied=True)
    assert owners(params, 3) == [2, 1, 0, 0]


@pytest.mark.parametrize("stage", [0, 3, True, "2"])
def test_zero_stage_must_be_1_or_2(stage):
    with pytest.raises(ValueError, match=f"zero_stage must be 1 or 2 .*got {type(stage).__name__}"):
        EngineConfig(zero_stage=stage)


def test_zero_stage_needs_the_distributed_optimizer():
    """A ZeRO stage without the distributed optimizer would be ignored: refused; with it, stage 2 by default."""
    with pytest.raises(ValueError, match="zero_stage=1 needs use_distributed_optimizer=True"):
        EngineConfig(zero_stage=1)
    assert EngineConfig(use_distributed_optimizer=True).zero_stage == 2
    assert EngineConfig().zero_stage is None
