"""What the engine refuses or decides before any work: batch and pipeline sizes that do not fit the mesh, the
layers each pipeline stage gets, and token ids past the vocabulary (checked on the host, before any forward)."""

from __future__ import annotations

import pytest
import torch
from families import CAUSAL_LM, batch
from test_engine import S, VOCAB, config_of

from tpzoo.engine.config import EngineConfig, check_fits
from tpzoo.engine.train_step import Engine
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("changes, pp, dp, message", [
    (dict(global_batch_size=12, micro_batch_size=4), 1, 2, "global batch size 12 is not divisible by micro batch "
                                                             "size x dp = 4 x 2 = 8"),
    (dict(schedule="interleaved-1f1b", global_batch_size=8, micro_batch_size=2), 4, 2,
     "needs at least pp=4 micro-batches per step, got 2"),
    (dict(), 4, 1, "num_layers=7 cannot be split evenly into 4 pipeline stages"),
    (dict(stage_layers=(3, 3)), 2, 1, "stage_layers=(3, 3) must give 2 stages (pp x virtual stages) summing to "
                                      "num_layers=7"),
    (dict(schedule="gpipe", virtual_stages=2), 2, 1, "virtual_stages=2 needs an interleaved schedule"),
])
def test_engine_misuse_fails_before_work(changes, pp, dp, message):
    with pytest.raises(ValueError) as info:
        check_fits(EngineConfig(**changes), 7, pp, dp)
    assert message in str(info.value)


def test_split_layers_weighs_embedding_and_head():
    from tpzoo.engine.config import split_layers

    assert [len(r) for r in split_layers(14, 8)] == [1, 2, 2, 2, 2, 2, 2, 1]
    assert [len(r) for r in split_layers(8, 4)] == [2, 2, 2, 2]
    assert split_layers(5, 2, (1, 4)) == [range(0, 1), range(1, 5)]


def bad_token_ids() -> list[str]:
    """A token id past the vocabulary, in the input and then in the labels: the engine's host-side check
    names each before any forward runs."""
    plan = ParallelPlan(init_mesh(), kernels="torch")
    config = config_of(CAUSAL_LM.name, 1)
    engine = Engine(lambda plan, **stage: CAUSAL_LM.build(config, plan, **stage), config,
                    EngineConfig(micro_batch_size=2, global_batch_size=2), plan)
    before = [p.detach().clone() for p in engine.params]
    messages = []
    for key in ("input_ids", "labels"):
        good = batch(CAUSAL_LM, torch.randint(0, VOCAB, (2, S)), torch.Generator().manual_seed(0))
        good[key][1, 3] = VOCAB + 4
        try:
            engine.train_step(good)
        except IndexError as e:
            messages.append(str(e))
    assert all(torch.equal(p, q) for p, q in zip(engine.params, before)) and engine.runner.chunks[0].calls == 0
    return messages


@pytest.mark.tier("distributed")
def test_engine_refuses_out_of_range_token_ids_on_the_host():
    assert spawn(bad_token_ids, 1, timeout=120)[0] == [
        f"input_ids must lie in [0, {VOCAB}); got {VOCAB + 4}..{VOCAB + 4}",
        f"labels must lie in [0, {VOCAB}) or equal ignore_index=-100; got {VOCAB + 4}..{VOCAB + 4}"]
