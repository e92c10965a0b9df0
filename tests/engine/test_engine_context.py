"""Context parallelism in the engine: on meshes (tp, pp, dp, cp) with cp 2 and 4, alone and beside tp (with
sequence parallelism), pp and dp (with ZeRO-1 and FSDP), with and without recompute, both attention modes (ring:
p2p; all-to-all: a2a), 10 steps of GPT, BERT (with its sentence-order head, read on the rank holding [CLS], and
without), Llama, Qwen2, Qwen3, Mistral's sliding window and GPT on packed documents equal the single-process run:
every step's loss and gradient norm and the final weights within 1e-5 (float32). Sequences of 64 tokens: at cp 4
each rank holds two chunks of 8 and the ring takes 4 steps. One 4-rank and one 8-rank spawn; each run is its own
case, named by family, mesh, mode, schedule and options.
"""

from __future__ import annotations

import functools

import background
import pytest
from cases import CaseLog, assert_case
from test_engine import STEPS, compare, ref_key, reference, train

from tpzoo.parallel import init_mesh

pytestmark = pytest.mark.tier("distributed")

SEQ, CP_STEPS = 64, 10
PLAIN = dict(use_distributed_optimizer=False, recompute_activations=False, sequence_parallel=False, fsdp=False)
ZERO1, FSDP = dict(PLAIN, use_distributed_optimizer=True, zero_stage=1), dict(PLAIN, fsdp=True)
RECOMPUTE, SP = dict(PLAIN, recompute_activations=True), dict(PLAIN, sequence_parallel=True)
# (tp, pp, dp, cp) -> runs (case, comm type, schedule, options)
RUNS = {
    (1, 1, 1, 4): [("gpt", "p2p", "1f1b", PLAIN), ("llama", "a2a", "1f1b", RECOMPUTE),
                   ("bert-mlm", "p2p", "1f1b", PLAIN), ("gpt-packed", "a2a", "1f1b", PLAIN),
                   ("qwen3", "p2p", "1f1b", PLAIN), ("bert", "p2p", "1f1b", PLAIN)],
    (2, 1, 1, 2): [("llama", "p2p", "1f1b", dict(SP, recompute_activations=True)), ("gpt", "a2a", "1f1b", SP),
                   ("bert-mlm", "a2a", "1f1b", SP), ("mistral", "p2p", "1f1b", PLAIN), ("qwen2", "a2a", "1f1b", SP),
                   ("bert", "a2a", "1f1b", SP)],
    (1, 2, 1, 2): [("llama", "p2p", "1f1b", PLAIN), ("bert-mlm", "p2p", "gpipe", RECOMPUTE),
                   ("gpt-packed", "p2p", "1f1b", PLAIN)],
    (1, 1, 2, 2): [("gpt", "p2p", "1f1b", ZERO1), ("llama", "a2a", "1f1b", FSDP), ("bert-mlm", "p2p", "1f1b", FSDP)],
    (2, 1, 1, 4): [("llama", "p2p", "1f1b", SP), ("gpt-packed", "p2p", "1f1b", dict(SP, recompute_activations=True))],
    (1, 1, 2, 4): [("gpt", "a2a", "1f1b", ZERO1), ("bert-mlm", "p2p", "1f1b", FSDP)],
    (1, 2, 1, 4): [("llama", "a2a", "gpipe", RECOMPUTE), ("bert", "p2p", "1f1b", PLAIN)],
}
FOUR = [mesh for mesh in RUNS if mesh[0] * mesh[1] * mesh[2] * mesh[3] == 4]
EIGHT = [mesh for mesh in RUNS if mesh[0] * mesh[1] * mesh[2] * mesh[3] == 8]


def run_name(name: str, mesh: tuple[int, int, int, int], comm: str, schedule: str, options: dict) -> str:
    on = [short for short, key in (("fsdp", "fsdp"), ("zero1", "use_distributed_optimizer"),
                                   ("recompute", "recompute_activations"), ("sp", "sequence_parallel")) if options[key]]
    tp, pp, dp, cp = mesh
    return f"{name}-tp{tp}-pp{pp}-dp{dp}-cp{cp}-{comm}-{schedule}-{'+'.join(on) or 'plain'}"


NAMES = {mesh: [run_name(name, mesh, *rest) for name, *rest in runs] for mesh, runs in RUNS.items()}


def references() -> dict:
    keys = {ref_key(name, mesh[0]): (name, mesh[0]) for mesh, runs in RUNS.items() for name, *_ in runs}
    return {key: reference(name, tp, seq=SEQ, steps=CP_STEPS) for key, (name, tp) in keys.items()}


@functools.cache
def refs() -> dict:
    return background.spawn(references, 1)[0]


def check_meshes(refs: dict, meshes: list[tuple[int, int, int, int]]) -> CaseLog:
    log = CaseLog()
    for tp, pp, dp, cp in meshes:
        mesh = init_mesh(tp=tp, pp=pp, dp=dp, cp=cp)
        for (name, comm, schedule, options), case in zip(RUNS[tp, pp, dp, cp], NAMES[tp, pp, dp, cp]):
            with log.case(case):
                engine, results = train(name, mesh, schedule, CP_STEPS, cp_comm_type=comm, seq=SEQ, **options)
                compare(engine, results, refs[ref_key(name, tp)], log)
    return log


@background.fixture
def four_ranks(tmp_path_factory) -> list[CaseLog]:
    return background.spawn(check_meshes, 4, refs(), FOUR, timeout=1200)


@background.fixture
def eight_ranks(tmp_path_factory) -> list[CaseLog]:
    return background.spawn(check_meshes, 8, refs(), EIGHT, timeout=1200)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for mesh in FOUR for n in NAMES[mesh]])
def test_context_parallel_four_ranks_equal_single_process(four_ranks, name):
    assert_case(four_ranks, name)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for mesh in EIGHT for n in NAMES[mesh]])
def test_context_parallel_eight_ranks_equal_single_process(eight_ranks, name):
    assert_case(eight_ranks, name)


@pytest.mark.tier("unit")
def test_context_parallel_runs_cover_the_acceptance_matrix():
    runs = [(mesh, *run) for mesh, mesh_runs in RUNS.items() for run in mesh_runs]
    assert {m[3] for m, *_ in runs} == {2, 4} and STEPS < CP_STEPS
    for axis in range(3):  # tp, pp and dp beside cp 2 and 4
        assert {m[3] for m, *_ in runs if m[axis] > 1} == {2, 4}, axis
    assert {r[2] for r in runs} == {"p2p", "a2a"}
    assert {"gpt", "bert", "bert-mlm", "llama", "gpt-packed", "mistral"} <= {r[1] for r in runs}
    for option in ("use_distributed_optimizer", "fsdp", "recompute_activations", "sequence_parallel"):
        assert any(r[4][option] for r in runs), option
