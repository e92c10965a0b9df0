"""FSDP in the engine (``ParallelPlan(fsdp=True)``: weights, gradients and optimizer state sharded over
dp by torch's FSDP2), issue 16's acceptance: the same-loss matrix, clipping, fp16's overflow decision.

A 4-rank spawn loops over the meshes (tp, pp, dp) of ``FOUR`` and an 8-rank one over ``EIGHT`` (the 3D mesh;
``test_engine`` says why the others run on 4 ranks), and they check, each a named case (``pytest -k 'fsdp and tp2'``):

- 5 steps of FSDP equal the single-rank run within 1e-5 (losses, loss parts, gradient norms, final
  weights: ``test_engine``'s references and ``compare``), three runs a mesh, the families and the option
  setting (recompute and sequence parallelism all on or all off) rotating (``test_engine.variants``'
  ``per_mesh``): every pretraining family with and without a pipeline, every mesh and every schedule FSDP
  allows (not interleaved-zero-bubble) both settings; a decoder classifier runs through a pipeline on one mesh. CLIP is
  small enough that every run clips (asserted), so the weights check the clipping too;
- bf16: FSDP's MixedPrecisionPolicy run (float32 shards cast for compute) tracks the plain bf16 engine
  (bf16 weights, float32 main weights) on the same mesh within HALF_TOL;
- fp16 from a huge loss scale: FSDP skips the same overflowing steps as the plain fp16 engine, ends at
  the same scale, and its clean steps match the plain engine's within HALF_TOL;
- per rank, FSDP holds its share of the weights: sum over dp of the local shards = the plain engine's
  parameters on that rank, the largest share within 1.1 / dp of them;
- the engine refuses FSDP with the distributed optimizer and with interleaved-zero-bubble.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import background
import pytest
import torch
import torch.distributed as dist
from cases import CaseLog, assert_case_of
from families import ENGINE_CLASSIFIERS, ENGINE_PRETRAINING
from test_engine import CLIP, PRETRAINING, SCHEDULES, refs, run_case, run_name, train, variants

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.fsdp_params import check_fsdp
from tpzoo.parallel import init_mesh
from tpzoo.parallel.fsdp import local

pytestmark = pytest.mark.tier("distributed")



FOUR = [(1, 1, 4), (2, 1, 2), (1, 2, 2)]  # (tp, pp, dp)
EIGHT = [(2, 2, 2)]
MESHES = FOUR + EIGHT
FSDP_SCHEDULES = tuple(s for s in SCHEDULES if s != "interleaved-zero-bubble")  # refused: see check_fsdp
CLASSIFIER_RUNS = {(2, 2, 2): (ENGINE_CLASSIFIERS[1], "interleaved-1f1b", True)}  # mesh: (case, schedule, options on)
FAMILIES = [name for name in PRETRAINING if name not in ENGINE_PRETRAINING]  # packed inputs: test_engine's matrix
ACCUMULATING = (2, 1, 2)  # a pp = 1 mesh whose runs take 2 micro-batches a step (the others: m = pp)
EXTRA_STEPS = 4          # the precision checks (the matrix runs test_engine's 5)
BF16 = ((2, 2, 2), "1f1b", dict(recompute_activations=True, sequence_parallel=True))  # mesh, schedule, options
# from 2^21 the scale backs off twice, then steps (measured: overflows at 2^24 .. 2^20, none at 2^19)
FP16 = ((1, 2, 2), "gpipe", dict(initial_loss_scale=2.0**21))
HALF_TOL = 1e-3          # FSDP vs the plain engine at bf16 / fp16 (measured: 1.1e-7, the same casts of the weights)
SHARE_TOL = 1.1          # largest dp rank's share of the weights, times dp (uneven rows: ceil(n / dp))
REFUSED = [("1f1b", dict(use_distributed_optimizer=True), 1, "turn off use_distributed_optimizer"),
           ("interleaved-zero-bubble", {}, 2, "use interleaved-1f1b")]  # schedule, config, pp, message


def fsdp_variants(index: int, tp: int, pp: int, dp: int) -> list[tuple[str, str, dict]]:
    """``test_engine.variants`` with FSDP over FSDP_SCHEDULES; on ACCUMULATING, 2 micro-batches a step, so that
    the engine's own accumulation at pp = 1 without a reduce (``sync_gradients_this_backward``) runs."""
    runs = variants(index, tp, pp, dp, fsdp=True, schedules=FSDP_SCHEDULES, classifier_runs=CLASSIFIER_RUNS,
                    per_mesh=len(FSDP_SCHEDULES), pipelined=len(FSDP_SCHEDULES), families=FAMILIES)
    m2 = (tp, pp, dp) == ACCUMULATING
    return [(name, schedule, {**options, "micro_batches": 2} if m2 else options) for name, schedule, options in runs]


RUN_NAMES = [run_name(name, *mesh, schedule, options) for index, mesh in enumerate(MESHES)
             for name, schedule, options in fsdp_variants(index, *mesh)]
SHARE_CASES = [f"fsdp-weights-1/dp-tp{tp}-pp{pp}-dp{dp}" for tp, pp, dp in MESHES]
BF16_CASE = f"fsdp-bf16-tracks-plain-bf16-{'tp{}-pp{}-dp{}'.format(*BF16[0])}-{BF16[1]}"
FP16_CASE = f"fsdp-fp16-skips-as-plain-fp16-{'tp{}-pp{}-dp{}'.format(*FP16[0])}-{FP16[1]}"
REFUSED_CASE = "fsdp-engine-refuses-distributed-optimizer-and-zero-bubble"
EXTRA_CASES = [*SHARE_CASES, BF16_CASE, FP16_CASE, REFUSED_CASE]


def weight_shares(fsdp, plain) -> list[int]:
    """Bytes of this rank's float32 shards summed over dp and the largest over dp; the plain engine's
    parameters on this rank (float32, unsharded)."""
    held = torch.tensor([sum(local(p).numel() * 4 for p in fsdp.params)] * 2)
    dist.all_reduce(held[:1], group=fsdp.mesh.dp_group)
    dist.all_reduce(held[1:], op=dist.ReduceOp.MAX, group=fsdp.mesh.dp_group)
    return [*held.tolist(), sum(p.numel() * 4 for p in plain.params)]


def check_shares(log: CaseLog, mesh, name: str, schedule: str, options: dict) -> list[int]:
    tp, pp, dp = mesh.tp_size, mesh.pp_size, mesh.dp_size
    with log.case(f"fsdp-weights-1/dp-tp{tp}-pp{pp}-dp{dp}"):
        fsdp, _ = train(name, mesh, schedule, steps=0, **options)
        summed, largest, plain = weight_shares(fsdp, train(name, mesh, schedule, steps=0)[0])
        assert summed == plain, f"the dp shards hold {summed} B, the plain engine's parameters {plain} B"
        assert largest * dp <= SHARE_TOL * plain, f"a dp rank holds {largest} B of {plain} B, not about 1/{dp}"
        return [largest, plain]


def check_bf16(log: CaseLog, mesh, schedule: str, options: dict) -> None:
    with log.case(BF16_CASE):
        runs = [train(PRETRAINING[0], mesh, schedule, EXTRA_STEPS, precision="bf16", fsdp=on, **options)[1]
                for on in (True, False)]
        for step, (a, b) in enumerate(zip(*runs)):
            assert not a.skipped and not b.skipped, f"step {step} skipped: {a}, {b}"
            for what in ("loss", "grad_norm"):
                log.close(torch.tensor(getattr(a, what)), torch.tensor(getattr(b, what)), f"step {step} {what}",
                          "bf16 vs plain bf16", HALF_TOL)


def check_fp16(log: CaseLog, mesh, schedule: str, options: dict) -> None:
    with log.case(FP16_CASE):
        (sharded, a), (plain, b) = (train(PRETRAINING[0], mesh, schedule, EXTRA_STEPS, precision="fp16", fsdp=on,
                                          **options) for on in (True, False))
        skipped = [r.skipped for r in b]
        assert any(skipped) and not all(skipped), f"the plain run should skip some steps, not all: {skipped}"
        assert [r.skipped for r in a] == skipped, f"FSDP skipped {[r.skipped for r in a]}, plain {skipped}"
        assert sharded.loss_scale == plain.loss_scale, f"loss scale {sharded.loss_scale} vs {plain.loss_scale}"
        for step, (x, y) in enumerate(zip(a, b)):
            if not y.skipped:
                log.close(torch.tensor([x.loss, x.grad_norm]), torch.tensor([y.loss, y.grad_norm]),
                          f"step {step} loss and grad norm", "fp16 vs plain fp16", HALF_TOL)


def check_refused(log: CaseLog, mesh) -> None:
    with log.case(REFUSED_CASE):
        for schedule, changes, _, message in REFUSED:
            with pytest.raises(ValueError, match=message):
                train(PRETRAINING[0], mesh, schedule, steps=0, fsdp=True, **changes)


def check_clipped(engine, results: list) -> None:
    assert max(r.grad_norm for r in results) > CLIP, f"no step clipped (CLIP={CLIP})"


def check_fsdp_meshes(refs: dict, meshes: list[tuple[int, int, int]]) -> tuple[CaseLog, dict]:
    """The cases of RUN_NAMES and EXTRA_CASES on ``meshes`` (of one world size); also (largest share, plain bytes)
    per mesh."""
    log, shares = CaseLog(), {}
    for tp, pp, dp in meshes:
        mesh = init_mesh(tp=tp, pp=pp, dp=dp)
        for name, schedule, options in fsdp_variants(MESHES.index((tp, pp, dp)), tp, pp, dp):
            run_case(log, refs, mesh, name, schedule, options, check_clipped)
        t0 = time.perf_counter()
        shares[tp, pp, dp] = check_shares(log, mesh, name, schedule, options)
        if (tp, pp, dp) == BF16[0]:
            check_bf16(log, mesh, *BF16[1:])
        if (tp, pp, dp) == FP16[0]:
            check_fp16(log, mesh, *FP16[1:])
            check_refused(log, mesh)
        if dist.get_rank() == 0:
            print(f"extra checks on {(tp, pp, dp)}: {time.perf_counter() - t0:.1f}s", flush=True)
    return log, shares


def fsdp_on_ranks(world: int, meshes: list[tuple[int, int, int]]) -> list[tuple[CaseLog, dict]]:
    t0 = time.perf_counter()
    out = background.spawn(check_fsdp_meshes, world, refs(), meshes, timeout=1200)
    print(f"FSDP spawn of {world} ranks: {time.perf_counter() - t0:.0f}s; max relative errors:",
          {k: f"{max(log.max.get(k, 0) for log, _ in out):.2e}" for k in out[0][0].max})
    print("FSDP weights per rank, the largest dp rank's shard vs the plain engine's (bytes, rank 0's pp stage):",
          out[0][1])
    return out


@background.fixture
def fsdp_four(tmp_path_factory) -> list[tuple[CaseLog, dict]]:
    return fsdp_on_ranks(4, FOUR)


@background.fixture
def fsdp_eight(tmp_path_factory) -> list[tuple[CaseLog, dict]]:
    return fsdp_on_ranks(8, EIGHT)


@pytest.fixture(scope="module")
def fsdp_ranks(fsdp_four, fsdp_eight) -> list[list[CaseLog]]:
    return [[log for log, _ in spawn] for spawn in (fsdp_four, fsdp_eight)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", RUN_NAMES)
def test_engine_fsdp_equals_single_rank(fsdp_ranks, name):
    assert_case_of(fsdp_ranks, name)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", EXTRA_CASES)
def test_engine_fsdp_keeps_the_engine_guarantees(fsdp_ranks, name):
    assert_case_of(fsdp_ranks, name)


@pytest.mark.tier("unit")
@pytest.mark.parametrize("schedule, changes, pp, message", REFUSED, ids=["distributed-optimizer", "zero-bubble"])
def test_engine_fsdp_misuse_refused(schedule, changes, pp, message):
    with pytest.raises(ValueError, match=message):
        check_fsdp(EngineConfig(schedule=schedule, **changes), SimpleNamespace(pp_size=pp, ep_size=1))


@pytest.mark.tier("unit")
def test_engine_fsdp_variants_cover_every_family_and_setting():
    runs = [(mesh, name, schedule, options) for index, mesh in enumerate(MESHES)
            for name, schedule, options in fsdp_variants(index, *mesh) if name in FAMILIES]
    assert all(options["fsdp"] and not options["use_distributed_optimizer"] for *_, options in runs)
    for mesh in MESHES:
        assert {r[3]["recompute_activations"] for r in runs if r[0] == mesh} == {False, True}, mesh
    for name in FAMILIES:  # every family through FSDP, with and without a pipeline
        assert {r[0][1] > 1 for r in runs if r[1] == name} == {False, True}, name
    for schedule in FSDP_SCHEDULES:
        assert {r[3]["recompute_activations"] for r in runs if r[2] == schedule} == {False, True}, schedule
    assert {r[2] for r in runs} == set(FSDP_SCHEDULES)
    assert len(set(RUN_NAMES)) == len(RUN_NAMES), "two runs share a case name"
