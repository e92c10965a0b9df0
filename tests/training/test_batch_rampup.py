"""Batch-size ramp-up and sample-counted runs against Megatron-LM's formulas, by hand (the expected
numbers are written out below, not computed by the code under test):

- ``BatchSchedule``: --rampup-batch-size START INCR SAMPLES (the classic calculator: B(c) = START +
  INCR floor(c / (SAMPLES / ((G - START) / INCR))) while c <= SAMPLES, then G), the iterations of
  --train-samples (Megatron's update_train_iters), --step-batch-size-schedule, and their misuse;
- the engine at pp=2 taking a global batch whose size changes between steps (m = 2, 4, 2, 6, 8, 10, 2
  micro-batches) logs the losses of one process;
- pretrain.py (one process; the two lines docs/training.md shows) with a ramp-up, --train-samples, a
  sample-counted linear decay and SGD: each iteration's lr and global_batch_size in metrics.jsonl, and a
  resume from the checkpoint of iteration 4 (mid-ramp) that logs the uninterrupted run's losses.
"""

from __future__ import annotations

import re
import shlex

import background
import pytest
import torch
from doc_helpers import blocks
from families import CAUSAL_LM, batch
from pretrain_helpers import metrics, pretrain, rel, script

from tpzoo.training.batch_schedule import BatchSchedule, parse_step_schedule
from tpzoo.training.optimizer_args import TrainingConfig

pytestmark = pytest.mark.tier("unit")



# --rampup-batch-size 2 2 16 to G 8: n = (8 - 2) / 2 = 3 increments, one every 16 / 3 samples
RAMP = BatchSchedule(8, rampup=(2, 2, 16))
# c (samples before) -> B:  0 -> 2, 2 -> 2, 4 -> 2 (4 < 16/3), 6 -> 4 (floor(6 / (16/3)) = 1), 10 -> 4,
# 14 -> 6 (floor(2.625) = 2), 20 -> 8 (c > 16), 28 -> 8, 36 -> 8
RAMP_SIZES = [2, 2, 2, 4, 4, 6, 8, 8, 8]
# --train-samples 48: ramp phase while c <= 16 (6 iterations, c = 20), then (48 - 20) // 8 = 3 more
RAMP_ITERS = 9


def sizes(schedule: BatchSchedule, iterations: int) -> list[int]:
    out, consumed = [], 0
    for _ in range(iterations):
        out.append(schedule.batch_at(consumed))
        consumed += out[-1]
    return out


def test_rampup_batch_sizes_and_train_samples_iterations():
    assert sizes(RAMP, RAMP_ITERS) == RAMP_SIZES
    assert RAMP.iterations(48) == RAMP_ITERS
    # inside the ramp, Megatron's loop also runs the iteration that starts at c == --train-samples:
    # c = 0, 2, 4, 6, 10 <= 10 -> 5 iterations (c = 14)
    assert RAMP.iterations(10) == 5
    assert RAMP.consumed_after(RAMP_ITERS) == sum(RAMP_SIZES) and RAMP.consumed_after(3, 6) == 6 + 4 + 4 + 6
    assert BatchSchedule(8).iterations(50) == 6 and RAMP.sizes() == [2, 4, 6, 8]
    RAMP.check(1, 2)
    with pytest.raises(ValueError, match=r"global batch sizes \[2, 6\] of the batch schedule are not multiples of "
                                         r"micro batch size x dp = 1 x 4 = 4"):
        RAMP.check(1, 4)
    with pytest.raises(ValueError, match="global batch size 8 - start 2 = 6 must be >= 0 and divisible by the "
                                         "increment 4"):
        BatchSchedule(8, rampup=(2, 4, 16))


def test_step_batch_size_schedule_in_tokens():
    # thresholds in tokens / seq length 16: 0, 64 -> 4, 0.16K = 160 -> 10 samples
    steps = parse_step_schedule("0:2 64:4 0.16K:8", 16)
    assert steps == ((0, 2), (4, 4), (10, 8))
    schedule = BatchSchedule(8, steps=steps)
    # c = 0 -> 2, 2 -> 2, 4 -> 4, 8 -> 4, 12 -> 8; --train-samples 20: iterations while c < 20 -> 5
    assert sizes(schedule, 5) == [2, 2, 4, 4, 8] and schedule.iterations(20) == 5
    assert parse_step_schedule("0:16 2.4B:320", 2048) == ((0, 16), (2_400_000_000 // 2048, 320))
    assert parse_step_schedule(["0:2", "64:4", "0.16K:8"], 16) == steps  # the words of an unquoted ${ARGS[@]}
    with pytest.raises(ValueError, match="must be >= 1 and end at --global-batch-size 16"):
        BatchSchedule(16, steps=steps)
    with pytest.raises(ValueError, match="give one of them"):
        TrainingConfig(global_batch_size=8, rampup_batch_size=[2, 2, 16], step_batch_size_schedule="0:8")


def test_step_schedule_gives_the_global_batch_size():
    """Megatron-LM takes G from the schedule's last size: pretrain.py's default --global-batch-size (32) gives
    way to it; a --global-batch-size given too must agree (the GPT-3 example gives both)."""
    pretrain_script = script()
    p = pretrain_script.parser()
    line = "--seq-length 16 --micro-batch-size 1 --train-iters 4 --lr-warmup-iters 1 --step-batch-size-schedule"
    for extra, g in (([], 8), (["--global-batch-size", "8"], 8), (["--global-batch-size", "16"], None)):
        argv = [*line.split(), "0:2 64:4 0.16K:8", *extra]
        args = p.parse_args(argv)
        if g is None:
            with pytest.raises(ValueError, match=r"batch sizes \[2, 4, 8\] must be >= 1 and end at "
                                                 r"--global-batch-size 16; make them agree, or leave out"):
                pretrain_script.check_flags(args, p.given(argv))
            continue
        pretrain_script.check_flags(args, p.given(argv))
        steps = parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
        assert args.global_batch_size == g and sizes(BatchSchedule(g, steps=steps), 5) == [2, 2, 4, 4, 8]
    with pytest.raises(ValueError, match="end at --global-batch-size 32"):  # a library caller: all flags given
        pretrain_script.check_flags(p.parse_args(argv[:-2]))


def test_rampup_over_zero_samples_is_refused():
    with pytest.raises(ValueError, match="--rampup-batch-size 2 2 0: a ramp from 2 to global batch size 8 needs "
                                         "SAMPLES > 0 to ramp over; give SAMPLES > 0, or START 8 for no ramp"):
        BatchSchedule(8, rampup=(2, 2, 0))
    assert sizes(BatchSchedule(8, rampup=(8, 2, 0)), 2) == [8, 8]  # no ramp: nothing to spread


def test_engine_micro_batches_of_each_batch_size():
    """m = B / (micro x dp) for each step's B; at pp > 1 the schedules' limits, one line naming the numbers."""
    from tpzoo.engine.config import EngineConfig, micro_batches

    one_f_one_b = EngineConfig(micro_batch_size=1, global_batch_size=8)
    assert [micro_batches(one_f_one_b, 2, 1, b) for b in RAMP.sizes()] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="needs at least pp=2 micro-batches per step, got 1 .global batch 2"):
        micro_batches(one_f_one_b, 2, 2, 2)
    interleaved = EngineConfig(micro_batch_size=1, global_batch_size=8, schedule="interleaved-1f1b")
    assert [micro_batches(interleaved, 1, 2, b) for b in (2, 3, 4, 6, 8)] == [2, 3, 4, 6, 8]  # rounds of m // 2
    with pytest.raises(ValueError, match="m // pp = 2 rounds, which must divide m = 5"):
        micro_batches(interleaved, 1, 2, 5)


# ------------------------------------------------------------------ the engine at pp=2, batch sizes changing
STEP_SIZES = (2, 4, 2, 6, 8, 10, 2)  # m = the size; 5 sizes: the runner keeps 4 schedules, rebuilds m = 2


def engine_losses(pp: int) -> list[float]:
    """The losses of a tiny GPT at pp ``pp`` trained by AdamW with --adam-beta1/2's betas on global batches of
    STEP_SIZES sequences (micro batch 1: m = the size)."""
    from tpzoo.engine.config import EngineConfig
    from tpzoo.engine.train_step import Engine
    from tpzoo.parallel import ParallelPlan, init_mesh

    plan = ParallelPlan(init_mesh(1, pp, 1), kernels="torch")
    config = CAUSAL_LM.config(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                              max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0)
    engine = Engine(lambda plan, **stage: CAUSAL_LM.build(config, plan, **stage), config,
                    EngineConfig(micro_batch_size=1, global_batch_size=10, lr=1e-2, adam_beta1=0.8,
                                 adam_beta2=0.95), plan)
    losses = []
    for step, size in enumerate(STEP_SIZES):
        g = torch.Generator().manual_seed(step)
        losses.append(engine.train_step(batch(CAUSAL_LM, torch.randint(0, 64, (size, 8), generator=g), g)).loss)
    assert engine.optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    return losses


@background.fixture
def pipeline_losses(tmp_path_factory) -> tuple[list[float], list[float]]:
    return background.spawn(engine_losses, 1, 1)[0], background.spawn(engine_losses, 2, 2)[0]


@pytest.mark.tier("journey")
def test_pipeline_takes_a_changing_batch_size(pipeline_losses):
    single, pp2 = pipeline_losses
    assert len(set(single)) == len(STEP_SIZES)  # the batches differ, so do their losses
    assert all(rel(a, b) < 1e-5 for a, b in zip(pp2, single)), (pp2, single)


# ------------------------------------------------------------------ pretrain.py: ramp-up, samples, resume
# the two lines docs/training.md shows: the run (ramp-up, --train-samples, sample-counted linear decay, SGD) and
# its resume from the checkpoint of iteration 4 (consumed samples 10, mid-ramp)
RUN, RESUME = [shlex.split(line)[2:] for block in blocks("training.md", "text") for line in block.splitlines()
               if "--rampup-batch-size" in line or "iter_0000004" in line]
# the lr of iteration i at the samples consumed before it, c = 0, 2, 4, 6, 10, 14, 20, 28, 36 (RAMP_SIZES);
# W = 4, D = 40: c <= 4 warmup 0.1 c / 4, else 0.01 + 0.09 (1 - (c - 4) / 36)
RUN_LRS = [0.0, 0.1 * 2 / 4, 0.1, 0.01 + 0.09 * (1 - 2 / 36), 0.01 + 0.09 * (1 - 6 / 36), 0.01 + 0.09 * (1 - 10 / 36),
           0.01 + 0.09 * (1 - 16 / 36), 0.01 + 0.09 * (1 - 24 / 36), 0.01 + 0.09 * (1 - 32 / 36)]


@background.fixture
def ramp_runs(tmp_path_factory):
    """The run to the end (checkpoints every 4 iterations), then the run resumed from its iteration 4."""
    root = tmp_path_factory.mktemp("rampup")
    return root, pretrain(RUN, root), pretrain(RESUME, root)


@pytest.mark.tier("journey")
def test_pretrain_logs_megatron_lr_and_batch_size_per_iteration(ramp_runs):
    root, full, _ = ramp_runs
    assert RUN[RUN.index("--rampup-batch-size"):][:4] == ["--rampup-batch-size", "2", "2", "16"]  # RAMP's
    log = metrics(root / "runs/ramp")
    assert sorted(log) == list(range(1, RAMP_ITERS + 1)), full.stdout[-2000:]
    assert [log[i]["global_batch_size"] for i in log] == RAMP_SIZES
    assert [log[i]["lr"] for i in log] == pytest.approx(RUN_LRS, rel=1e-12, abs=1e-15)


@pytest.mark.tier("journey")
def test_resume_mid_ramp_continues_the_run(ramp_runs):
    root, _, resumed = ramp_runs
    full, again = metrics(root / "runs/ramp"), metrics(root / "runs/ramp-resumed")
    assert re.search(r"resumed from \S+iter_0000004 at iteration 4 \(consumed samples 10\)", resumed.stdout)
    assert sorted(again) == list(range(5, RAMP_ITERS + 1)), resumed.stdout[-2000:]
    for i in again:
        assert again[i]["global_batch_size"] == full[i]["global_batch_size"] and again[i]["lr"] == full[i]["lr"]
        assert rel(again[i]["loss"], full[i]["loss"]) < 1e-6, (i, again[i], full[i])
