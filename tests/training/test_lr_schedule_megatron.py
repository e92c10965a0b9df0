"""The learning-rate schedule against Megatron-LM's OptimizerParamScheduler, by hand: each expected lr
below is written out from its formulas (docs/training.md), not computed by the code under test.

Megatron steps its scheduler by the global batch after each update, so iteration i runs at the lr of
n = the samples consumed before it; warmup and decay lengths are samples (iterations x global batch
for the *-iters flags)."""

from __future__ import annotations

import argparse
import math

import pytest

from tpzoo.training.args import add_parallel_args, add_precision_args
from tpzoo.training.lr_schedule import LRSchedule
from tpzoo.training.optimizer_args import (TrainingConfig, add_optimizer_args, fill_schedule_defaults,
                                           set_model_defaults)
from tpzoo.training.run_config import RunConfig, section_of

pytestmark = pytest.mark.tier("unit")




def flags(line: str, defaults: dict | None = None) -> argparse.Namespace:
    """The flags of ``line``; ``defaults``: a family's training defaults (pretrain.py's MODEL_DEFAULTS)."""
    p = argparse.ArgumentParser()
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--model", default="m")
    add_parallel_args(p)
    add_precision_args(p)
    add_optimizer_args(p)
    families = {"m": defaults or {"train_iters": 100, "lr_warmup_iters": 0}}  # as pretrain.py's MODEL_DEFAULTS
    set_model_defaults(p, families)
    return fill_schedule_defaults(p.parse_args(line.split()), families)


def lrs(line: str, defaults: dict | None = None) -> tuple[list[float], list[int]]:
    """(lr, global batch size) of every iteration of the run the flags describe, as the loop steps them."""
    args = flags(line, defaults)
    training = section_of(TrainingConfig, vars(args))
    batches = training.batches(args.seq_length)
    schedule = training.lr_schedule(batches)
    out, sizes, consumed = [], [], 0
    for _ in range(training.iterations(batches)):
        out.append(schedule.lr_at(consumed))
        sizes.append(batches.batch_at(consumed))
        consumed += sizes[-1]
    return out, sizes


def test_iteration_based_cosine_with_warmup_fraction_and_decay_iters():
    # D = 8 iterations x G 8 = 64 samples, W = 0.25 x 64 = 16 samples; iteration i runs at n = 8 (i - 1)
    got, sizes = lrs("--global-batch-size 8 --train-iters 10 --lr 0.01 --min-lr 0.001 --lr-decay-style cosine "
                     "--lr-decay-iters 8 --lr-warmup-fraction 0.25")
    cos = lambda r: 0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * r))  # noqa: E731
    expected = [0.0, 0.01 * 8 / 16, 0.01, cos(8 / 48), cos(16 / 48), cos(24 / 48), cos(32 / 48), cos(40 / 48),
                0.001, 0.001]  # n = 64: r = 1; n = 72 > D: min_lr
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert sizes == [8] * 10


def test_sample_based_linear_with_warmup_init():
    # --train-samples 40 at G 4: 10 iterations; W = 6, D = 30 samples; n = 4 (i - 1)
    got, sizes = lrs("--global-batch-size 4 --train-samples 40 --lr 1e-3 --min-lr 1e-4 --lr-decay-style linear "
                     "--lr-warmup-samples 6 --lr-decay-samples 30 --lr-warmup-init 1e-4")
    lin = lambda r: 1e-4 + 9e-4 * (1 - r)  # noqa: E731
    expected = [1e-4, 1e-4 + 9e-4 * 4 / 6, lin(2 / 24), lin(6 / 24), lin(10 / 24), lin(14 / 24), lin(18 / 24),
                lin(22 / 24), 1e-4, 1e-4]  # n = 32, 36 > D: min_lr
    assert got == pytest.approx(expected, rel=1e-12)
    assert sizes == [4] * 10


def test_inverse_square_root_wsd_and_weight_decay_increment():
    # G 2, 8 iterations: W = 2 x 2 = 4 samples, D = 16; n = 2 (i - 1)
    got, _ = lrs("--global-batch-size 2 --train-iters 8 --lr 1.0 --min-lr 0.1 --lr-warmup-iters 2 "
                 "--lr-decay-style inverse-square-root")
    assert got == pytest.approx([0.0, 0.5, 1.0, math.sqrt(4 / 6), math.sqrt(4 / 8), math.sqrt(4 / 10),
                                 math.sqrt(4 / 12), math.sqrt(4 / 14)], rel=1e-12)
    # WSD: stable up to D - A = 16 - 8 = 8 samples, then linear anneal over A = 8: q = (n - 8) / 8
    got, _ = lrs("--global-batch-size 2 --train-iters 8 --lr 1.0 --min-lr 0.0 --lr-decay-style WSD "
                 "--lr-wsd-decay-style linear --lr-wsd-decay-iters 4")
    assert got == pytest.approx([1.0] * 5 + [1 - 2 / 8, 1 - 4 / 8, 1 - 6 / 8], rel=1e-12)
    # the same in samples, exponential anneal 2 * 0.5^q - 1: --train-samples 16 at G 2, A = 8 samples
    got, _ = lrs("--global-batch-size 2 --train-samples 16 --lr 1.0 --min-lr 0.0 --lr-decay-style WSD "
                 "--lr-wsd-decay-samples 8")
    assert got == pytest.approx([1.0] * 5 + [2 * 0.5 ** (2 / 8) - 1, 2 * 0.5 ** (4 / 8) - 1, 2 * 0.5 ** (6 / 8) - 1],
                                rel=1e-12)
    args = flags("--global-batch-size 2 --train-iters 8 --weight-decay-incr-style linear --start-weight-decay 0.0 "
                 "--end-weight-decay 0.1")
    training = section_of(TrainingConfig, vars(args))
    schedule = training.lr_schedule(training.batches(args.seq_length))
    assert [schedule.wd_at(n) for n in (0, 4, 16, 18)] == pytest.approx([0.0, 0.1 * 4 / 16, 0.1, 0.1])


def test_family_iteration_defaults_give_way_to_sample_flags():
    """A family's --train-iters/--lr-warmup-iters defaults do not apply to a run counted in samples."""
    args = flags("--global-batch-size 4 --train-samples 40", {"train_iters": 300, "lr_warmup_iters": 30})
    assert args.train_iters is None and args.lr_warmup_iters == 0
    args = flags("--global-batch-size 4 --lr-warmup-fraction 0.1", {"train_iters": 300, "lr_warmup_iters": 30})
    assert args.train_iters == 300 and args.lr_warmup_iters == 0


def test_earlier_checkpoint_schedule_is_read_in_samples():
    """tpzoo's earlier schedule state (iterations) compares with the samples of its global batch."""
    schedule = LRSchedule(1e-3, 0.0, 8.0, 80.0)
    old = dict(lr=1e-3, min_lr=0.0, warmup_iters=1, decay_iters=10, style="cosine")
    assert schedule.changes_from(old, global_batch_size=8) == []
    assert schedule.changes_from(dict(old, decay_iters=20), global_batch_size=8) == ["decay_steps: 160 -> 80.0"]
    assert schedule.changes_from({**schedule.state_dict(), "min_lr": 1e-4}) == ["min_lr: 0.0001 -> 0.0"]


def test_a_warmup_that_outlasts_the_decay_is_named():
    """Megatron-LM asserts warmup < decay; tpzoo runs such a schedule (a family's default warmup in a short run)
    and says the lr never reaches --lr."""
    assert LRSchedule(1e-3, 0.0, 8.0, 80.0).warmup_outlasts_decay() is None
    note = LRSchedule(1e-3, 0.0, 240.0, 16.0).warmup_outlasts_decay()
    assert note.startswith("the lr warmup (240 samples) does not end before the decay does (16 samples)"), note
    assert LRSchedule(1e-3, 0.0, 240.0, 16.0, "constant").warmup_outlasts_decay() is None


def test_optimizer_flags_reach_the_optimizer():
    """--optimizer, --adam-beta1/2, --adam-eps, --sgd-momentum: validated EngineConfig fields that build_optimizer
    (the one place the engine makes its optimizer, ZeRO and FSDP alike) hands to torch."""
    import torch

    from tpzoo.engine.config import EngineConfig
    from tpzoo.engine.data_parallel import build_optimizer, set_hyperparameters
    args = flags("--optimizer sgd --sgd-momentum 0.5 --weight-decay 0.1 --lr 0.2")
    params = [torch.nn.Parameter(torch.ones(2))]
    sgd = build_optimizer(params, RunConfig.of(vars(args)).engine(), torch.device("cpu"))
    assert isinstance(sgd, torch.optim.SGD) and (sgd.defaults["momentum"], sgd.defaults["weight_decay"]) == (0.5, 0.1)
    args = flags("--adam-beta1 0.8 --adam-beta2 0.95 --adam-eps 1e-6")
    adam = build_optimizer(params, RunConfig.of(vars(args)).engine(), torch.device("cpu"))
    assert isinstance(adam, torch.optim.AdamW) and (adam.defaults["betas"], adam.defaults["eps"]) == ((0.8, 0.95), 1e-6)
    adam.param_groups[0].update(betas=(0.5, 0.5), eps=1.0, weight_decay=0.5)  # a checkpoint's groups, restored
    set_hyperparameters(adam, RunConfig.of(vars(args)).engine())  # after loading: the resumed run's flags win
    assert {k: adam.param_groups[0][k] for k in ("betas", "eps", "weight_decay")} == dict(betas=(0.8, 0.95), eps=1e-6,
                                                                                        weight_decay=0.01)
    for bad, match in ((dict(optimizer="lion"), "optimizer"), (dict(adam_beta2=1.0), "adam_beta2 must be < 1")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)


def test_train_defaults_naming_no_flag_refused():
    # an outside family's train_defaults keys are the flags' destinations: another name is one clear error
    with pytest.raises(ValueError, match="train_defaults of model 'm' name learning_rate, which are no flags"):
        flags("--global-batch-size 4", {"train_iters": 10, "learning_rate": 1e-3})
