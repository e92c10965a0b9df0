"""tpzoo.training.health: a checkpoint is judged by the step after it; the stop line's advice."""

from __future__ import annotations

import math

import pytest

from tpzoo.training.health import GRAD_FACTOR, LOSS_FACTOR, Health

pytestmark = pytest.mark.tier("unit")


def steps(health: Health, *losses_and_norms: tuple[float, float], first: int = 1) -> list[str | None]:
    return [health.step(first + i, loss, norm) for i, (loss, norm) in enumerate(losses_and_norms)]


def test_a_checkpoint_is_confirmed_by_a_sane_step_after_it():
    health = Health()
    steps(health, (6.2, 1.4))
    health.saved("run/iter_0000001")
    assert health.confirmed is None and health.pending == "run/iter_0000001"
    steps(health, (6.1, 1.5), first=2)
    assert health.confirmed == "run/iter_0000001" and health.pending is None and health.reference == 6.2
    assert health.advice("start again") == "the last checkpoint that trains on is run/iter_0000001; resume from it"


@pytest.mark.parametrize("loss, norm, why", [
    (math.nan, math.nan, "a non-finite loss"),
    (3.7e12, 3.3e6, f"loss 3.7e+12, over {LOSS_FACTOR:g}x the run's first 6.2"),
    (6.0, 150.0 * GRAD_FACTOR, f"gradient norm 1.5e+04, over {GRAD_FACTOR:g}x the median of the run's last ones"),
])
def test_an_exploded_step_drops_the_checkpoint_before_it(loss, norm, why):
    health = Health()
    steps(health, (6.2, 1.0), (6.1, 1.5), (6.0, 1.2))
    health.saved("run/iter_0000003")
    steps(health, (6.0, 1.1), first=4)
    health.saved("run/iter_0000004")
    steps(health, (loss, norm), first=5)
    assert health.confirmed == "run/iter_0000003" and health.pending is None
    assert health.advice("start again") == (f"the last checkpoint that trains on is run/iter_0000003 "
                                            f"(run/iter_0000004 gave {why} at iteration 5); resume from it")


def test_advice_without_a_checkpoint_that_trains_on():
    assert Health().advice("start again") == "no checkpoint was saved; start again"
    health = Health(pending="run/iter_0000007", reference=6.0)  # resumed: the run's first loss from the checkpoint
    steps(health, (13.0, 2.0), first=8)
    assert health.advice("start again") == ("no checkpoint of this run trains on (run/iter_0000007 gave loss 13, "
                                            "over 2x the run's first 6 at iteration 8); start again")


def test_a_skipped_step_with_a_sane_loss_confirms_and_an_inf_gradient_norm_is_not_judged():
    health = Health(pending="run/iter_0000002", reference=6.0)
    steps(health, (6.1, math.inf), first=3)  # fp16 overflow: the loss judges the weights
    assert health.confirmed == "run/iter_0000002"


def test_steps_with_every_gradient_zero_are_counted_and_the_first_of_a_streak_named():
    health = Health()
    lines = steps(health, (6.2, 0.0), (6.2, 0.0), (6.1, 1.0), (6.1, 0.0))
    assert lines == ["iteration 1: every gradient is zero (gradient norm 0); the step changes no weight", None, None,
                     "iteration 4: every gradient is zero (gradient norm 0); the step changes no weight"]
    assert health.zero_steps == 1 and list(health.norms) == [1.0]
