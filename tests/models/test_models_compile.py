"""``ParallelPlan(compile=True)`` trains every family of ``families.MAIN`` as eager does: the losses of
5 AdamW steps within 1e-5 of the eager model's at tp 1 and 2 with torch.compile's aot_eager backend (every
family traced, each layer and the head compiled to one graph: no graph break, the layer traced once for
every layer), and with inductor (torch kernels, generated C++ here) at tp 1 for ``INDUCTOR`` and at tp 2 for
``INDUCTOR_TP2`` (inductor compiles what aot_eager traced, the collectives included): one family per kind
of layer code, as inductor's code generation costs seconds a graph; with dropout, sequence parallelism and
recompute (aot_eager: the same random masks as eager) the same losses for ``DROPOUT`` (the layers the others
vary by biases, norms or masks), the only graph breaks the tp-stream dropouts; the Triton kernels
(torch.ops.tpzoo custom ops, interpreted) under aot_eager; and the pipeline engine (pp 2) with compiled
stages (``ENGINE_PP2``: a causal LM of each kind of positions and the encoder, whose mask every stage takes).
One spawn of 1 rank (tp 1) and, at the same time, one of 2 gloo ranks (the rest); each check is its own test
case (``cases``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import background
import pytest
import torch
from cases import CaseLog, assert_case
from families import CASES, MAIN, Case, batch
from torch._dynamo.utils import counters

from tpzoo.engine import Engine, EngineConfig
from tpzoo.models.compile import BACKEND_ENV
from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed, sync_sequence_parallel_grads

pytestmark = pytest.mark.tier("distributed")



B, S, VOCAB, STEPS = 2, 8, 101, 5
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=VOCAB,
            max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
BACKENDS = ("aot_eager", "inductor")
# inductor at tp 1: the encoder (the GPT-2 layer's LayerNorm and GELU, and a padding mask) and the Llama layer with
# all its options (grouped-query attention, rotary, RMSNorm on q and k, a head size not h / n); at tp 2 the GPT-2
# layer. bert-cls, llama, qwen2 and mistral add a head, drop the norms, add biases or change the mask's values,
# which aot_eager's graphs already check: inductor compiles the same ops (about a minute a family here)
INDUCTOR = ("bert", "qwen3")
INDUCTOR_TP2 = MAIN[:1]
DROPOUT = ("gpt", "bert", "llama")  # qwen2, qwen3 and mistral are the Llama decoder with options
ENGINE_PP2 = ([n for n in MAIN if CASES[n].inputs == "causal-lm"][:2]
              + [n for n in MAIN if CASES[n].inputs != "causal-lm"][:1])
TOL = 1e-5


def config_of(case: Case, **changes):
    return case.config(**{**TINY, **({"num_labels": 3} if case.inputs == "classification" else {}), **changes})


def inputs(case: Case, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return batch(case, torch.randint(0, VOCAB, (B, S), generator=g), g)


def train(case: Case, config, plan: ParallelPlan) -> torch.Tensor:
    """The losses [STEPS] of AdamW steps on the mean of each per-token (per-sequence) loss."""
    manual_seed(7, plan.mesh)
    model = case.build(config, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        out = model(**inputs(case, step))
        loss = sum(part.mean() for part in (out if isinstance(out, tuple) else (out,)))
        loss.backward()
        sync_sequence_parallel_grads(model, plan.mesh.tp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def breaks() -> list[str]:
    """The graph-break reasons dynamo counted since the last ``torch._dynamo.reset``, one line each."""
    return [reason.splitlines()[0] for reason in counters["graph_break"]]


def compiled(case: Case, config, plan: ParallelPlan, backend: str, monkeypatch: pytest.MonkeyPatch
             ) -> torch.Tensor:
    """``train`` with ``plan.replace(compile=True)`` under ``backend``, from a clean dynamo cache."""
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setenv(BACKEND_ENV, backend)
    return train(case, config, plan.replace(compile=True))


def check_family(log: CaseLog, name: str, tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both backends at ``tp``; at tp 2 also dropout with sequence parallelism and recompute (aot_eager)."""
    case = CASES[name]
    config, plan = config_of(case), ParallelPlan(init_mesh(tp=tp), kernels="torch")
    eager = train(case, config, plan)
    for backend in backends(name, tp):
        with log.case(f"{name}-{backend}-tp{tp}"):
            losses = compiled(case, config, plan, backend, monkeypatch)
            assert not breaks(), f"graph breaks: {breaks()}"
            # one graph for the layers (traced once, reused by the second), one for the head
            assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
            log.close(losses, eager, "losses", "compiled vs eager", TOL)
    if tp == 1 or name not in DROPOUT:
        return
    with log.case(f"{name}-dropout-sp-recompute-tp{tp}"):
        config = config_of(case, hidden_dropout=0.2, attention_dropout=0.2)
        plan = plan.replace(sequence_parallel=True, recompute_activations=True, attention_backend="fused-softmax")
        eager = train(case, config, plan)
        losses = compiled(case, config, plan, "aot_eager", monkeypatch)
        assert breaks() and all("in_tp_stream" in reason or "compiler.disable" in reason for reason in breaks()), \
            breaks()
        log.close(losses, eager, "losses", "compiled vs eager", TOL)


def check_triton(log: CaseLog, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels (custom ops; interpreted here) inside the compiled graphs, tp 2, aot_eager."""
    case = CASES[name]
    with log.case(f"{name}-triton-aot_eager-tp2"):
        plan = ParallelPlan(init_mesh(tp=2), kernels="triton", attention_backend="fused-softmax")
        eager = train(case, config_of(case), plan)
        losses = compiled(case, config_of(case), plan, "aot_eager", monkeypatch)
        assert not breaks(), f"graph breaks: {breaks()}"
        log.close(losses, eager, "losses", "compiled vs eager", TOL)


def engine_losses(name: str, plan: ParallelPlan) -> list[float]:
    case = CASES[name]
    config = config_of(case)
    manual_seed(7, plan.mesh)
    engine = Engine(lambda plan, **stage: case.build(config, plan, **stage), config,
                    EngineConfig(micro_batch_size=1, global_batch_size=2 * B, schedule="1f1b", lr=1e-2), plan)
    return [engine.train_step({k: torch.cat([v, v.flip(0)]) for k, v in inputs(case, step).items()}).loss
            for step in range(STEPS)]


def checks(tp: int) -> CaseLog:
    """The cases at ``tp`` (one rank: tp 1; two ranks: tp 2, Triton, and the engine at pp 2)."""
    log = CaseLog()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)  # no worker pool on a small CPU
        for name in MAIN:
            check_family(log, name, tp, monkeypatch)
        if tp == 1:
            return log
        check_triton(log, MAIN[0], monkeypatch)
        plan = ParallelPlan(init_mesh(tp=1, pp=2), kernels="torch")
        for name in ENGINE_PP2:
            with log.case(f"{name}-engine-pp2"):
                eager = engine_losses(name, plan)
                torch._dynamo.reset()
                monkeypatch.setenv(BACKEND_ENV, "aot_eager")
                log.close(torch.tensor(engine_losses(name, plan.replace(compile=True))), torch.tensor(eager),
                          "losses", "compiled vs eager", TOL)
    return log


def backends(name: str, tp: int) -> tuple[str, ...]:
    return BACKENDS if name in (INDUCTOR if tp == 1 else INDUCTOR_TP2) else BACKENDS[:1]


NAMES = ([f"{name}-{backend}-tp{tp}" for tp in (1, 2) for name in MAIN for backend in backends(name, tp)]
         + [f"{name}-dropout-sp-recompute-tp2" for name in DROPOUT] + [f"{MAIN[0]}-triton-aot_eager-tp2"]
         + [f"{name}-engine-pp2" for name in ENGINE_PP2])


@background.fixture
def logs(tmp_path_factory) -> dict[int, list[CaseLog]]:
    """Both spawns at once: compiling is single-threaded, so the 1-rank spawn alone would leave a core idle."""
    with ThreadPoolExecutor(2) as pool:
        runs = {tp: pool.submit(background.spawn, checks, tp, tp, timeout=1200) for tp in (1, 2)}
        return {tp: run.result() for tp, run in runs.items()}


@pytest.mark.parametrize("name", NAMES)
def test_compiled_trains_as_eager(logs, name):
    assert_case(logs[1 if name.endswith("-tp1") else 2], name)
