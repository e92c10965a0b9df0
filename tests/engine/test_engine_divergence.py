"""Divergence in the engine: a non-finite loss or gradient norm skips the step on every rank (no update,
weights unchanged) at fp32, bf16 and fp16; ``engine.bad_steps`` counts the skips that count toward
``--max-skipped-steps`` (fp32/bf16: all; fp16: overflows at the minimum scale); fp16's scale follows
Megatron's schedule (hysteresis, minimum, growth window, static ``--loss-scale``) and resumes from a
checkpoint's state; metrics.jsonl stays strict JSON.

One spawn of 2 ranks at tp 2 runs the engine checks, each a named case (``pytest -k fp16-static``);
the NaN is injected on one rank only (a gradient hook, or a loss made non-finite on tp rank 1 alone),
so every check also shows that the ranks agree. The rest needs no process group.
"""

from __future__ import annotations

import json
import logging
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from cases import CaseLog, assert_case
from families import CASES, MAIN, batch

from tpzoo.engine import train_step
from tpzoo.engine.config import EngineConfig
from tpzoo.engine.loss_scale import DynamicLossScaler
from tpzoo.engine.train_step import Engine
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.testing import spawn
from tpzoo.training.args import add_parallel_args, add_precision_args, command_parser
from tpzoo.training.run_config import RunConfig
from tpzoo.training.metrics import Metrics
from tpzoo.training.optimizer_args import add_optimizer_args

pytestmark = pytest.mark.tier("unit")



NAME, G, S, VOCAB = MAIN[0], 4, 8, 64
TINY = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=VOCAB,
            max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0)
CASE_NAMES = ("fp32-nan-grad-on-one-rank-skips-everywhere", "bf16-nan-grad-on-one-rank-skips-everywhere",
              "fp16-overflow-on-one-rank-skips-everywhere", "nan-loss-on-one-tp-rank-skips-everywhere",
              "fp32-huge-lr-diverges-weights-stay-finite", "bf16-huge-lr-diverges-weights-stay-finite",
              "fp16-hysteresis-then-min-scale-counts", "fp16-clean-step-keeps-hysteresis-growth-restores-it",
              "fp16-static-scale", "warning-on-rank-0-only", "one-host-sync-on-a-skipped-step")


def global_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return batch(CASES[NAME], torch.randint(0, VOCAB, (G, S), generator=g), g)


def engine(mesh, precision: str = "fp32", **options) -> Engine:
    config = CASES[NAME].config(**TINY)
    plan = ParallelPlan(mesh, kernels="torch", sequence_parallel=True)
    return Engine(lambda plan, **stage: CASES[NAME].build(config, plan, **stage), config,
                  EngineConfig(micro_batch_size=2, global_batch_size=G, precision=precision, **options), plan)


def weights(e: Engine) -> list[torch.Tensor]:
    """Model weights and main weights (float32; the same tensors at fp32), copied."""
    return [p.detach().clone() for p in [*e.params, *e.main.params]]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def poisoned_step(e: Engine, step: int, value: float = float("nan"), rank: int = 1):
    """A step whose gradient of one weight is multiplied by ``value`` on ``rank`` alone."""
    hook = e.params[0].register_hook(lambda g: g * value) if dist.get_rank() == rank else None
    try:
        return e.train_step(global_batch(step))
    finally:
        if hook is not None:
            hook.remove()


def skips_everywhere(e: Engine, step: int, **poison) -> None:
    """A poisoned step is skipped (on this rank; every rank runs it) and changes no weight."""
    before = weights(e)
    result = poisoned_step(e, step, **poison)
    assert result.skipped, f"rank {dist.get_rank()}: step {step} was not skipped ({result})"
    assert same(weights(e), before), f"rank {dist.get_rank()}: a skipped step changed the weights"


def nan_on_one_rank(log: CaseLog, mesh, precision: str) -> None:
    with log.case(f"{precision}-nan-grad-on-one-rank-skips-everywhere"):
        e = engine(mesh, precision)
        assert not e.train_step(global_batch(0)).skipped and e.bad_steps == 0
        skips_everywhere(e, 1)
        assert e.bad_steps == 1 and e.skipped_steps == 1 and e.loss_scale == 1.0
        skips_everywhere(e, 2, value=float("inf"), rank=0)
        assert e.bad_steps == 2, f"fp32/bf16 count every skipped step, got {e.bad_steps}"
        before = weights(e)
        assert not e.train_step(global_batch(3)).skipped and e.bad_steps == 0, "an update resets bad_steps"
        assert not same(weights(e), before), "a finite step after skipped ones updates"


def diverge(log: CaseLog, mesh, precision: str) -> None:
    """lr 1e4: the weights blow up within a few steps; each non-finite step is skipped (the weights stay
    as they were, all finite: another batch may still give a finite step) and bad_steps counts the
    skipped steps since the last update."""
    with log.case(f"{precision}-huge-lr-diverges-weights-stay-finite"):
        e, skipped, run = engine(mesh, precision, lr=1e4), [], 0
        for step in range(6):
            before = weights(e)
            r = e.train_step(global_batch(step))
            assert r.skipped == (not (math.isfinite(r.loss) and math.isfinite(r.grad_norm))), r
            assert not r.skipped or same(weights(e), before), f"skipped step {step} changed the weights"
            run = run + 1 if r.skipped else 0
            assert e.bad_steps == run, f"step {step}: bad_steps {e.bad_steps}, skipped in a row {run}"
            skipped.append(r.skipped)
        assert any(skipped), "lr 1e4 never gave a non-finite step"
        assert all(torch.isfinite(w).all() for w in weights(e)), "non-finite weights were published"


def fp16_schedule(log: CaseLog, mesh) -> None:
    with log.case("fp16-overflow-on-one-rank-skips-everywhere"):
        e = engine(mesh, "fp16", initial_loss_scale=1024.0)
        skips_everywhere(e, 0, value=float("inf"), rank=1)
        assert e.loss_scale == 512.0 and e.bad_steps == 0, "hysteresis 1: back off; not at the minimum: no count"
    with log.case("fp16-hysteresis-then-min-scale-counts"):
        e = engine(mesh, "fp16", initial_loss_scale=8.0, min_loss_scale=2.0, hysteresis=2)
        seen = []
        for step in range(5):
            skips_everywhere(e, step, value=float("inf"))
            seen.append((e.loss_scale, e.bad_steps))
        # the 1st overflow is tolerated, the 2nd and 3rd halve the scale down to 2, from then on they count
        assert seen == [(8.0, 0), (4.0, 0), (2.0, 0), (2.0, 1), (2.0, 2)], seen
        assert not e.train_step(global_batch(5)).skipped and e.bad_steps == 0 and e.scaler.clean_steps == 1
    with log.case("fp16-clean-step-keeps-hysteresis-growth-restores-it"):
        e = engine(mesh, "fp16", initial_loss_scale=4.0, loss_scale_window=2, hysteresis=2)
        steps = iter(range(100))
        poisoned_step(e, next(steps), value=float("inf"))             # tolerated: 4
        e.train_step(global_batch(next(steps)))                        # clean: the count stays
        poisoned_step(e, next(steps), value=float("inf"))             # 2nd since the last growth: 2
        assert e.loss_scale == 2.0, f"Megatron: a clean step does not restore the hysteresis, scale {e.loss_scale}"
        for _ in range(2):
            e.train_step(global_batch(next(steps)))
        assert e.loss_scale == 4.0, f"2 clean steps in a row (window 2) double the scale, got {e.loss_scale}"
        poisoned_step(e, next(steps), value=float("inf"))
        assert e.loss_scale == 4.0, "a growth restores the hysteresis: the next overflow is tolerated"
    with log.case("fp16-static-scale"):
        e = engine(mesh, "fp16", loss_scale=4.0, loss_scale_window=1)
        skips_everywhere(e, 0, value=float("inf"))
        skips_everywhere(e, 1, value=float("inf"))
        assert e.loss_scale == 4.0 and e.bad_steps == 2, "a static scale stays; its every overflow counts"
        for step in range(2, 4):
            assert not e.train_step(global_batch(step)).skipped
        assert e.loss_scale == 4.0 and e.bad_steps == 0, "a static scale never grows"


def checks(log: CaseLog) -> CaseLog:
    mesh = init_mesh(tp=2)
    torch.manual_seed(0)
    for precision in ("fp32", "bf16"):
        nan_on_one_rank(log, mesh, precision)
    with log.case("nan-loss-on-one-tp-rank-skips-everywhere"):
        e = engine(mesh)
        real = train_step.reduce_losses

        def nan_on_rank_1(total, parts, groups):
            sums = real(total, parts, groups)
            return sums * float("nan") if dist.get_rank() == 1 else sums

        before = weights(e)
        with mock.patch.object(train_step, "reduce_losses", nan_on_rank_1):
            result = e.train_step(global_batch(0))
        assert result.skipped and e.bad_steps == 1, f"rank {dist.get_rank()}: {result}, bad {e.bad_steps}"
        assert same(weights(e), before)
    fp16_schedule(log, mesh)
    for precision in ("fp32", "bf16"):
        diverge(log, mesh, precision)
    with log.case("warning-on-rank-0-only"):
        e, lines = engine(mesh), []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger(train_step.__name__).addHandler(handler)
        try:
            for step in range(2):
                poisoned_step(e, step)
        finally:
            logging.getLogger(train_step.__name__).removeHandler(handler)
        expected = 2 if dist.get_rank() == 0 else 0
        assert len(lines) == expected, f"rank {dist.get_rank()}: {lines}"
        assert all("step skipped on every rank: non-finite loss or gradient norm" in line for line in lines), lines
        assert not lines or lines[-1].endswith("2 bad steps in a row"), lines
    with log.case("one-host-sync-on-a-skipped-step"):
        from test_engine_precision import counting_syncs

        e = engine(mesh, "fp16")
        e.train_step(global_batch(0))
        with counting_syncs(e.optimizer) as calls:
            assert poisoned_step(e, 1, value=float("inf")).skipped
        assert calls == ["tolist"], calls
    return log


@pytest.fixture(scope="module")
def logs() -> list[CaseLog]:
    return spawn(checks, 2, CaseLog(), timeout=300)


@pytest.mark.tier("distributed")
@pytest.mark.parametrize("name", CASE_NAMES)
def test_divergence(logs, name):
    assert_case(logs, name)


def test_scaler_resumes_its_schedule_with_the_runs_settings():
    saved = DynamicLossScaler(scale=256.0, growth_interval=10, hysteresis=3)
    saved.update(finite=False)
    saved.update(finite=True)
    resumed = DynamicLossScaler(scale=2.0**16, min_scale=4.0, growth_interval=5, hysteresis=2)
    resumed.resume(saved.state_dict())
    assert (resumed.scale, resumed.clean_steps, resumed.hysteresis_left) == (256.0, 1, 2), resumed
    assert (resumed.min_scale, resumed.growth_interval, resumed.hysteresis) == (4.0, 5, 2), "the flags' settings"
    old = dict(scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000, min_scale=1.0, clean_steps=3)
    before_hysteresis = DynamicLossScaler(hysteresis=2)
    before_hysteresis.resume(old)  # the record of a checkpoint written before hysteresis existed
    assert (before_hysteresis.scale, before_hysteresis.clean_steps, before_hysteresis.hysteresis_left) == (8.0, 3, 2)
    static = DynamicLossScaler(scale=4.0, static=True)
    static.resume(saved.state_dict())
    assert static.scale == 4.0, "a static scale is the flag's, never the checkpoint's"


def test_loss_scale_config_is_checked():
    for bad, match in ((dict(loss_scale=8.0), "loss_scale=8.0 needs precision='fp16'"),
                       (dict(precision="fp16", initial_loss_scale=4.0, min_loss_scale=8.0),
                        "min_loss_scale=8.0 exceeds initial_loss_scale=4.0"),
                       (dict(precision="fp16", hysteresis=0), "hysteresis"),
                       (dict(precision="fp16", loss_scale_window=0), "loss_scale_window"),
                       (dict(timeout_s=0.0), "timeout_s")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    p = command_parser("pretrain.py", "")
    for add in (add_parallel_args, add_optimizer_args, add_precision_args):
        add(p)
    config = RunConfig.of(vars(p.parse_args(["--fp16", "--distributed-timeout-minutes", "0.5"]))).engine()
    assert (config.loss_scale, config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
            config.hysteresis, config.timeout_s) == (None, 2.0**16, 1.0, 1000, 2, 30.0), config
    config = RunConfig.of(vars(p.parse_args(["--fp16", "--loss-scale", "1024", "--hysteresis", "3"]))).engine()
    assert (config.loss_scale, config.hysteresis) == (1024.0, 3)
    with pytest.raises(ValueError, match="--min-loss-scale, --hysteresis set the fp16 loss scale, but this run is "
                                         "bf16; add --fp16 or drop them"):
        RunConfig.of(vars(p.parse_args(["--bf16", "--min-loss-scale", "2", "--hysteresis", "3"]))).engine()
    with pytest.raises(SystemExit):
        p.parse_args(["--distributed-timeout-minutes", "0"])


def test_metrics_jsonl_is_strict_json(tmp_path, capsys):
    metrics = Metrics(tmp_path, 3, 1, interactive=False, writers=[])
    metrics.log(1, loss=4.5, lr=1e-3, grad_norm=0.5)
    metrics.log(2, loss=float("nan"), lr=1e-3, grad_norm=float("inf"), skipped=True, loss_scale=4.0)
    metrics.close()

    def refuse(token: str):
        raise ValueError(f"metrics.jsonl holds {token}, not JSON")

    first, second = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "metrics.jsonl").open()]
    assert (first["skipped"], first["loss_scale"]) == (False, 1.0), first
    assert (second["loss"], second["grad_norm"], second["skipped"], second["loss_scale"]) == (None, None, True, 4.0)
    printed = capsys.readouterr().out.splitlines()
    assert "SKIPPED" not in printed[0] and "loss scale" not in printed[0], printed[0]
    assert "loss nan" in printed[1] and "loss scale 4" in printed[1] and "SKIPPED (no update)" in printed[1], printed
