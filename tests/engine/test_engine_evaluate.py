"""Forward-only evaluation through the engine equals the single-rank model (one 4-rank spawn; each
run is its own test case, named by family, mesh, schedule and options), and runs through the
training schedule between training steps (one 2-rank spawn); the engine hands its plan to the
stage builder (no spawn).

Every case of ``families.MAIN``, with dropout on in the config: the engine's chunks must run in
eval mode (the references do) and return to train mode afterwards. Meshes (tp, pp, dp): (2, 2, 1)
with sequence parallelism, (1, 2, 2), (1, 4, 1) interleaved with virtual stages (some chunks
empty), (2, 1, 2). Per run: ``eval_loss`` and ``eval_losses`` (each label key's part), the
per-element losses of ``forward_only`` on every pp rank, and the logits of ``eval_logits``.
"""

from __future__ import annotations

from types import SimpleNamespace

import background
import pytest
import torch
from cases import CaseLog, assert_case
from families import CASES, MAIN, batch, without_labels
from torch import nn

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.evaluate import eval_logits, eval_loss, eval_losses, forward_only
from tpzoo.engine.pipeline import build_chunks
from tpzoo.engine.train_step import Engine
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")



G, S, VOCAB, LABELS = 16, 8, 101, 3
TINY = dict(num_layers=6, hidden_size=32, num_attention_heads=8, ffn_hidden_size=64, vocab_size=VOCAB,
            max_position_embeddings=S)
DROPOUT, NO_DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1), dict(hidden_dropout=0.0, attention_dropout=0.0)
# (tp, pp, dp, schedule, sequence parallel)
RUNS = [(2, 2, 1, "1f1b", True), (1, 2, 2, "1f1b", False), (1, 4, 1, "interleaved-1f1b", False),
        (2, 1, 2, "1f1b", False)]


def config_of(name: str, **changes):
    case = CASES[name]
    extra = {"num_labels": LABELS} if case.inputs == "classification" else {}
    return case.config(**{**TINY, **extra, **changes})


def build_of(name: str, config):
    return lambda plan, **stage: CASES[name].build(config, plan, **stage)


def plan_of(mesh, sequence_parallel: bool = False) -> ParallelPlan:
    return ParallelPlan(mesh, kernels="torch", sequence_parallel=sequence_parallel)


def batch_of(name: str) -> dict[str, torch.Tensor]:
    """A global batch [G, S] of the case with one entry of every label key ignored (-100), so that no
    count equals the number of its entries."""
    out = batch(CASES[name], torch.randint(0, VOCAB, (G, S), generator=torch.Generator().manual_seed(3)),
                torch.Generator().manual_seed(5), LABELS)
    for key in set(out) - set(without_labels(out)):
        out[key].view(-1)[3] = -100
    return out


def run_name(name: str, tp: int, pp: int, dp: int, schedule: str, sp: bool) -> str:
    return f"{name}-tp{tp}-pp{pp}-dp{dp}-{schedule}{'-sp' if sp else ''}"


def references() -> dict:
    """Single rank, eval mode, per case: the mean loss of each label key, the per-element losses (numpy)
    and the logits (the first output without labels)."""
    plan = plan_of(init_mesh())
    out = {}
    with torch.no_grad():
        for name in MAIN:
            model = CASES[name].build(config_of(name, **DROPOUT), plan).eval()
            b = batch_of(name)
            losses = model(**b)
            losses = losses if isinstance(losses, tuple) else (losses,)
            keys = [k for k in model.label_keys if k in b]
            parts = {k: (t.sum() / (b[k] != -100).sum()).item() for t, k in zip(losses, keys)}
            logits = model(**without_labels(b))
            logits = logits[0] if isinstance(logits, tuple) else logits
            out[name] = (parts, [t.numpy() for t in losses], logits.numpy())
    return out


def evaluate(refs: dict) -> CaseLog:
    log = CaseLog()
    for tp, pp, dp, schedule, sp in RUNS:
        mesh = init_mesh(tp=tp, pp=pp, dp=dp)
        for name in MAIN:
            with log.case(run_name(name, tp, pp, dp, schedule, sp)):
                config = config_of(name, **DROPOUT)
                engine = Engine(build_of(name, config), config,
                                EngineConfig(micro_batch_size=G // (dp * pp), global_batch_size=G, schedule=schedule),
                                plan_of(mesh, sp))
                b = batch_of(name)
                ref_parts, ref_losses, ref_logits = refs[name]
                before = [p.detach().clone() for p in engine.params]
                loss = eval_loss(engine, b)
                total, parts = eval_losses(engine, b)
                outputs = forward_only(engine, b)  # every pp rank gets them
                logits = eval_logits(engine, b)
                assert total == loss and parts.keys() == ref_parts.keys(), f"eval_losses {total}, {parts}"
                log.close(torch.tensor(loss), torch.tensor(sum(ref_parts.values())), "eval_loss", "loss", 1e-6)
                for key, value in ref_parts.items():
                    log.close(torch.tensor(parts[key]), torch.tensor(value), f"{key} part", "loss", 1e-6)
                rows = slice(mesh.dp_rank * G // dp, (mesh.dp_rank + 1) * G // dp)  # this dp rank's sequences
                m = G // (dp * engine.config.micro_batch_size)  # this dp rank's micro-batches of the G rows
                assert len(outputs) == m and all(len(o) == len(ref_losses) for o in outputs), outputs
                for j, ref in enumerate(ref_losses):
                    got = torch.cat([o[j] for o in outputs])
                    log.close(got, torch.from_numpy(ref)[rows], f"forward_only output {j}", "losses", 1e-5)
                log.close(logits, torch.from_numpy(ref_logits), "eval_logits", "logits", 1e-5)
                assert all(c.training for c in engine.chunks), "train mode not restored"
                assert all(torch.equal(p, q) for p, q in zip(engine.params, before)), "weights changed"
    return log


@background.fixture
def logs(tmp_path_factory) -> list[CaseLog]:
    refs = background.spawn(references, 1)[0]
    out = background.spawn(evaluate, 4, refs, timeout=900)
    print("max errors (relative):", {k: f"{max(log.max.get(k, 0) for log in out):.2e}" for k in out[0].max})
    return out


@pytest.mark.parametrize("name", [run_name(n, *run) for run in RUNS for n in MAIN])
def test_forward_only_equals_single_rank(logs, name):
    assert_case(logs, name)


def alternate() -> dict:
    """pp=2, no dropout: the loss of a training step equals ``eval_loss`` just before it on the same batch
    (same weights, the same schedule run forward only), twice, so the schedule switches between
    forward-only and training both ways; for the plain and the zero-bubble (action runtime) schedules,
    each with another case."""
    mesh = init_mesh(pp=2)
    out = {}
    for i, schedule in enumerate(("1f1b", "interleaved-zero-bubble")):
        name = MAIN[i % len(MAIN)]
        config, b = config_of(name, **NO_DROPOUT), batch_of(name)
        engine = Engine(build_of(name, config), config,
                        EngineConfig(micro_batch_size=G // 2, global_batch_size=G, schedule=schedule, lr=1e-2),
                        plan_of(mesh))
        pairs = [(eval_loss(engine, b), engine.train_step(b).loss) for _ in range(2)]
        for step, (evaluated, trained) in enumerate(pairs):
            assert abs(trained - evaluated) <= 1e-6 * evaluated, f"{name} {schedule} step {step}: eval " \
                                                                    f"{evaluated}, train step {trained}"
        assert pairs[1][0] < pairs[0][0], f"{name} {schedule}: the step did not lower the loss on its batch: {pairs}"
        out[name, schedule] = pairs
    return out


def test_eval_between_train_steps_runs_the_training_schedule():
    print(spawn(alternate, 2, timeout=120)[0])


class FakeStage(nn.Module):
    """Just the attributes of ``tpzoo.models.base.PipelineStage``."""

    label_keys = ("labels",)

    def __init__(self, plan, *, pre_process: bool, post_process: bool, layers: range) -> None:
        super().__init__()
        self.plan, self.pre_process, self.post_process = plan, pre_process, post_process
        self.layer_numbers = list(layers)

    def boundary_shape(self, micro_batch_size: int, seq_length: int) -> tuple[int, ...]:
        return (micro_batch_size, seq_length, 4)


@pytest.mark.tier("unit")
def test_build_chunks_hands_the_plan_to_the_builder():
    """pp rank 1 of pp=2 with 4 stages (interleaved): stages 1 and 3, each built from the plan; a builder
    that returns something else than a pipeline stage, or a stage not built for the plan, is refused by name."""
    plan = SimpleNamespace(mesh=SimpleNamespace(pp_rank=1, pp_size=2))
    layers = [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    chunks = build_chunks(FakeStage, layers, plan)
    assert [(c.model.plan, c.model.pre_process, c.model.post_process, c.model.layer_numbers) for c in chunks] == \
        [(plan, False, False, [1]), (plan, False, True, [3])]
    with pytest.raises(TypeError, match="the builder returned a Linear, not a pipeline stage"):
        build_chunks(lambda plan, **stage: nn.Linear(2, 2), layers, plan)
    with pytest.raises(TypeError, match="returned a FakeStage not built for this plan; build stages with "
                                        "tpzoo.models.build_model"):  # a plain model, say: nothing split
        build_chunks(lambda plan, **stage: FakeStage(None, **stage), layers, plan)
