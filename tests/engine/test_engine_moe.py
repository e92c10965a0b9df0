"""The mixture-of-experts family in the engine (issue 28): Mixtral's tiny case (4 experts, top 2) with its router's
per-sequence losses in the training loss (``families.MOE_AUX_LM``) on 4 gloo ranks, each mesh against the single-rank
run of ``test_engine`` (5 AdamW steps: losses, gradient norms and every final weight within 1e-5): data parallelism
with ZeRO-2 or FSDP and recompute (the router's losses counted once over the dp ranks and micro-batches), tensor
parallelism with sequence parallelism (the other tp ranks' tokens of each sequence added), pipelines (each stage's
layers adding theirs), and expert parallelism (ep 2 and 4 carved out of dp: each rank holds 4/ep experts, tokens
reach them by all-to-all; with ZeRO-1 and -2, with FSDP (the experts sharded over their edp ranks), with tp and
sequence parallelism, with a pipeline), and on 8 ranks
(``EIGHT``, in the background: ep 2 and 4 beside tp 2 or pp 2 at dp 4, ep 4 at dp 8, all four axes at 2) and 2
(``TWO``); ``TPZOO_ENGINE_MATRIX=full``: every mesh (``every_mesh``). The router losses each step logs are the same
on every mesh. Megatron-LM's options (``families.MOE_OPTIONS_LM``: sigmoid scores, the load balance over each
micro-batch, a capacity factor dropping tokens, the experts as one grouped multiply) on meshes with ep, tp and
sequence parallelism, and a pipeline, against the single-process engine with the same micro-batches
(the balance and the drops are per micro-batch). Each run is its own case (``-k 'ep2'``).

The anchors' bugs (issue 28): with ep x tp > 1 a gradient norm that undercounts the experts (Megatron-LM #1628) or
expert gradients doubled (DeepSpeed #5259, pytorch #160285) show in the gradient norms, which must equal the single
process's at every step on every ep mesh (every run clips: ``test_engine.CLIP``), and a missing expert gradient in the
final weights; ``test_expert_gradients_counted_once`` compares the reduced expert gradients themselves."""

from __future__ import annotations

import background
import pytest
import torch
from cases import CaseLog, assert_case
from families import CASES, MOE_AUX_LM, MOE_OPTIONS_LM
from test_engine import (CLIP, FULL, TINY, TOL, G, S, config_of, global_batch, loss_parts, options_of, reference,
                         ref_key, run_case, run_name, train)

from tpzoo.models import full_state_dict
from tpzoo.models.sharding import full_grads
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")

NAME = MOE_AUX_LM.name
# (tp, pp, dp, ep[, "fsdp" | "zero1"]) -> (schedule, ZeRO-2 / recompute / sequence parallelism on, FSDP in place of
# ZeRO-2); "zero1": ZeRO-1 in place of ZeRO-2
RUNS = {(1, 1, 4, 1): ("1f1b", True, False), (2, 1, 2, 1): ("1f1b", True, False), (1, 2, 2, 1): ("1f1b", False, False),
        (2, 2, 1, 1): ("interleaved-1f1b", True, False), (4, 1, 1, 1): ("1f1b", False, False),
        (2, 1, 2, 1, "fsdp"): ("1f1b", True, True),
        (1, 1, 4, 2): ("1f1b", True, False), (1, 1, 4, 4): ("1f1b", False, False), (2, 1, 2, 2): ("1f1b", True, False),
        (1, 2, 2, 2): ("gpipe", False, False), (1, 1, 4, 2, "fsdp"): ("1f1b", True, True),
        (2, 1, 2, 2, "fsdp"): ("1f1b", True, True), (1, 1, 4, 2, "zero1"): ("1f1b", True, False),
        (2, 1, 2, 2, "zero1"): ("1f1b", True, False)}


# on 8 ranks, in the background, and on 2
EIGHT = {(2, 1, 4, 2): ("1f1b", True, False), (1, 2, 4, 4): ("1f1b", False, False), (1, 1, 8, 4): ("1f1b", True, False),
         (2, 2, 2, 2): ("interleaved-1f1b", True, False)}
TWO = {(1, 1, 2, 2, "zero1"): ("1f1b", True, False), (2, 1, 1, 1): ("1f1b", False, False)}
SETTINGS = ("zero2", "plain", "fsdp", "zero1")  # a tag's options (``run_options``); at dp 1: "recompute" or "plain"


def every_mesh(world: int) -> dict:
    """Every (tp, pp, dp, ep) of ``world`` ranks that the tiny Mixtral allows (tp dividing its 8 heads, ep its 4
    experts and dp), mesh i tagged SETTINGS[i mod 4] (at dp 1: recompute and sequence parallelism, or none), at pp > 1
    with schedule i mod 3 of 1f1b, gpipe and (at pp 2: 6 layers) interleaved-1f1b. TPZOO_ENGINE_MATRIX=full runs them
    all besides the default runs."""
    meshes = [(tp, pp, world // (tp * pp), ep) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8)
              if world % (tp * pp) == 0 for ep in (1, 2, 4) if world // (tp * pp) % ep == 0]
    out = {}
    for i, (tp, pp, dp, ep) in enumerate(meshes):
        setting = SETTINGS[i % 4] if dp > 1 else ("recompute", "plain")[i % 2]
        schedules = ("1f1b", "gpipe", "interleaved-1f1b")[:3 if pp == 2 else 2] if pp > 1 else ("1f1b",)
        out[tp, pp, dp, ep, setting] = (schedules[i % len(schedules)], setting != "plain", setting == "fsdp")
    return out


def run_options(mesh: tuple, on: bool, fsdp: bool) -> dict:
    """``test_engine.options_of``, with ZeRO-1 for a mesh tagged "zero1", no distributed optimizer for "recompute"."""
    tags = mesh[4:]
    return {**options_of(on, mesh[0], fsdp), **({"zero_stage": 1} if "zero1" in tags else {}),
            **({"use_distributed_optimizer": False} if "recompute" in tags else {})}


def names(runs: dict) -> list[str]:
    return [run_name(NAME, *mesh[:3], schedule, run_options(mesh, on, fsdp), mesh[3])
            for mesh, (schedule, on, fsdp) in runs.items()]


def with_every_mesh(runs: dict, world: int) -> dict:
    """``runs`` and, under TPZOO_ENGINE_MATRIX=full, the runs of ``every_mesh`` not among them (by name)."""
    known = set(names(runs))
    return {**runs, **{m: v for m, v in every_mesh(world).items() if FULL and names({m: v})[0] not in known}}


RUNS, EIGHT, TWO = with_every_mesh(RUNS, 4), with_every_mesh(EIGHT, 8), with_every_mesh(TWO, 2)
NAMES, EIGHT_NAMES, TWO_NAMES = names(RUNS), names(EIGHT), names(TWO)
OPTIONS = MOE_OPTIONS_LM.name
MICRO = 4  # dp x m of every options run: micro-batches of G / 4 sequences, as the single process's
# (tp, pp, dp, ep) -> (schedule, ZeRO-2 / recompute / sequence parallelism on), grouped multiply throughout
OPTION_RUNS = {(1, 1, 4, 2): ("1f1b", False), (2, 1, 2, 2): ("1f1b", True), (1, 2, 2, 1): ("gpipe", False)}
OPTION_NAMES = [run_name(OPTIONS, *mesh[:3], schedule, {**options_of(on, mesh[0]), "micro_batches": MICRO // mesh[2]},
                         mesh[3]) for mesh, (schedule, on) in OPTION_RUNS.items()]
GRADS_MESH = (2, 1, 2, 2)  # (tp, pp, dp, ep): ep x tp = 4, with sequence parallelism
GRADS_CASE = "mixtral-expert-gradients-counted-once-tp2-pp1-dp2-ep2-sp"
EXPERT_WEIGHTS = "experts.dense_"  # the stacked expert weights' names contain it


def expert_grads() -> dict:
    """Single process: the gradient of every expert weight of the first step's global batch (numpy, by name)."""
    model = CASES[NAME].build(config_of(NAME, GRADS_MESH[0]), ParallelPlan(init_mesh(), kernels="torch"))
    b = global_batch(NAME, 0)
    sum(loss_parts(model, model(**b), b).values()).backward()
    return {n: p.grad.numpy() for n, p in model.named_parameters() if EXPERT_WEIGHTS in n}


def engine_reference(name: str) -> tuple:
    """The single-process engine, MICRO micro-batches a step, as ``test_engine.reference`` returns a reference."""
    engine, results = train(name, init_mesh(), "1f1b", micro_batches=MICRO, grouped_gemm=True)
    state = {key: t.numpy() for key, t in full_state_dict(engine.chunks[0].model, engine.mesh).items()}
    return [r.loss for r in results], state, [r.grad_norm for r in results], [r.losses for r in results]


def references() -> dict:
    return {**{ref_key(NAME, tp): reference(NAME, tp) for tp in sorted({mesh[0] for mesh in RUNS})},
            "expert-grads": expert_grads(), ref_key(OPTIONS, 1): engine_reference(OPTIONS)}


def check_expert_grads(log: CaseLog, want: dict) -> None:
    """After one step on ``GRADS_MESH``: every expert weight's reduced gradient, gathered over tp and ep, is the single
    process's (undone the clip the step applied): none counted twice over ep or dp, none missing."""
    tp, pp, dp, ep = GRADS_MESH
    mesh = init_mesh(tp=tp, pp=pp, dp=dp, ep=ep)
    with log.case(GRADS_CASE):
        engine, (result,) = train(NAME, mesh, "1f1b", steps=1, sequence_parallel=True)
        clipped = min(1.0, CLIP / (result.grad_norm + 1e-6))
        grads = {n: g for chunk in engine.chunks for n, g in full_grads(chunk.model, mesh).items()
                 if EXPERT_WEIGHTS in n}
        assert grads.keys() == want.keys(), f"expert gradients {sorted(grads)} vs {sorted(want)}"
        for name, g in want.items():
            log.close(grads[name] / clipped, torch.from_numpy(g), name, "expert gradient", TOL)


def check(refs: dict) -> tuple[CaseLog, dict[str, list[dict[str, float]]], dict[str, list]]:
    """Each run's case, and the router losses and tokens per expert its steps logged (``StepResult.router_losses``,
    ``StepResult.expert_tokens``)."""
    log, router, tokens = CaseLog(), {}, {}

    def logged(name: str, results: list) -> None:
        router[name], tokens[name] = [r.router_losses for r in results], [r.expert_tokens for r in results]

    run_all(log, refs, RUNS, logged)
    for (tp, pp, dp, ep), (schedule, on) in OPTION_RUNS.items():
        options = {**options_of(on, tp), "micro_batches": MICRO // dp, "grouped_gemm": True}
        run_case(log, refs, init_mesh(tp=tp, pp=pp, dp=dp, ep=ep), OPTIONS, schedule, options)
    check_expert_grads(log, refs["expert-grads"])
    return log, router, tokens


def run_all(log: CaseLog, refs: dict, runs: dict, logged=lambda name, results: None) -> CaseLog:
    """Each of ``runs`` as its case; ``logged(name, results)`` after each."""
    for mesh, (schedule, on, fsdp) in runs.items():
        (tp, pp, dp, ep, *_), options = mesh, run_options(mesh, on, fsdp)
        name = run_name(NAME, tp, pp, dp, schedule, options, ep)
        run_case(log, refs, init_mesh(tp=tp, pp=pp, dp=dp, ep=ep), NAME, schedule, options,
                 lambda engine, results, name=name: logged(name, results))
    return log


def references_of(runs: dict) -> dict:
    return {ref_key(NAME, tp): reference(NAME, tp) for tp in sorted({mesh[0] for mesh in runs})}


def on_ranks(runs: dict, world: int) -> list[CaseLog]:
    """``runs`` in a spawn of ``world`` ranks (from the background), against references of their tp sizes."""
    refs = background.spawn(references_of, 1, runs)[0]
    return background.spawn(run_all, world, CaseLog(), refs, runs, timeout=3600 if FULL else 1200)


@pytest.fixture(scope="module")
def ranks() -> list[tuple[CaseLog, dict, dict]]:
    return spawn(check, 4, spawn(references, 1)[0], timeout=900)


@background.fixture
def eight_ranks(tmp_path_factory) -> list[CaseLog]:
    return on_ranks(EIGHT, 8)


@background.fixture
def two_ranks(tmp_path_factory) -> list[CaseLog]:
    return on_ranks(TWO, 2)


@pytest.fixture(scope="module")
def logs(ranks) -> list[CaseLog]:
    return [log for log, *_ in ranks]


def test_every_mesh_has_a_case(logs):
    assert logs[0].ran == [*NAMES, *OPTION_NAMES, GRADS_CASE]


def test_expert_gradients_counted_once(logs):
    """The anchors' bugs (module docstring): with ep x tp > 1, each expert weight's gradient equals the single
    process's, gathered over tp and ep."""
    assert_case(logs, GRADS_CASE)


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
    for _, router, _ in ranks:
        for mesh, name in zip(RUNS, NAMES):
            for step, want in zip(router[name], first[ref_key(NAME, mesh[0])]):
                assert all(abs(step[k] - v) <= 1e-5 * abs(v) for k, v in want.items()), (name, step, want)


def test_every_mesh_logs_the_same_tokens_per_expert(ranks):
    """Each step's tokens per expert per layer (the slots routed to it over the global batch): every layer's
    add up to the batch's tokens times top-k, and each model's are the same on every mesh and rank."""
    config = MOE_AUX_LM.config()
    slots, first = G * S * config.moe_router_topk, {}
    for mesh, name in zip(RUNS, NAMES):
        first.setdefault(ref_key(NAME, mesh[0]), ranks[0][2][name])
    for steps in first.values():
        assert len(steps) == 5 and all(len(step) == TINY["num_layers"] for step in steps), steps
        assert all(len(row) == config.num_experts and sum(row) == slots for step in steps for row in step), steps
    for _, _, tokens in ranks:
        for mesh, name in zip(RUNS, NAMES):
            assert tokens[name] == first[ref_key(NAME, mesh[0])], name


@pytest.mark.parametrize("name", NAMES + OPTION_NAMES)
def test_moe_engine_equals_single_rank(logs, name):
    assert_case(logs, name)


def test_every_eight_and_two_rank_mesh_has_a_case(eight_ranks, two_ranks):
    assert eight_ranks[0].ran == EIGHT_NAMES and two_ranks[0].ran == TWO_NAMES


@pytest.mark.parametrize("name", EIGHT_NAMES)
def test_moe_engine_on_eight_ranks_equals_single_rank(eight_ranks, name):
    assert_case(eight_ranks, name)


@pytest.mark.parametrize("name", TWO_NAMES)
def test_moe_engine_on_two_ranks_equals_single_rank(two_ranks, name):
    assert_case(two_ranks, name)
