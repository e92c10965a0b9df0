"""A stuck or dead peer ends a training step, within the timeout and a roll call, with an error on the
surviving ranks that names the missing rank and its mesh coordinates (``tpzoo.parallel.health``)."""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from functools import partial

import background
import pytest
import torch
import torch.distributed as dist
from families import CAUSAL_LM

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.train_step import Engine
from tpzoo.parallel import init_mesh
from tpzoo.parallel.rollcall import roll_call
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")



TIMEOUT_S = 3.0
VICTIM = 2  # of the dying peer's 4 ranks: pp_rank 1, dp_rank 0, the last stage of the first pipeline


def tiny_engine(pp: int, dp: int) -> Engine:
    mesh = init_mesh(pp=pp, dp=dp, timeout=timedelta(seconds=TIMEOUT_S))
    config = CAUSAL_LM.config(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=101,
                              max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0)
    return Engine(partial(CAUSAL_LM.build, config), config,
                  EngineConfig(micro_batch_size=1, global_batch_size=2 * dp, timeout_s=TIMEOUT_S), mesh)


def failed_step(engine: Engine) -> tuple[str, float]:
    """The error message of a step that must fail, and how long it took."""
    ids = torch.randint(0, 101, (engine.config.global_batch_size, 8), generator=torch.Generator().manual_seed(0))
    start = time.monotonic()
    try:
        engine.train_step(dict(input_ids=ids, labels=ids))
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    raise AssertionError(f"rank {dist.get_rank()}: the step finished without its peer")


def step_with_a_stuck_peer() -> tuple[str, float] | None:
    engine = tiny_engine(pp=2, dp=1)
    if dist.get_rank() == 1:
        time.sleep(3 * TIMEOUT_S)  # alive, but never joins the step
        return None
    return failed_step(engine)


# each spawn mostly waits for a timeout: a background fixture of its own (``waits=True``), beside the other jobs
@background.fixture(waits=True)
def stuck_peer(tmp_path_factory) -> tuple[str, float]:
    return spawn(step_with_a_stuck_peer, 2, timeout=120)[0]


@background.fixture(waits=True)
def dying_peer(tmp_path_factory) -> list:
    return spawn(step_with_a_dying_peer, 4, VICTIM, timeout=120, may_exit=[VICTIM])


@background.fixture(waits=True)
def store_host_gone(tmp_path_factory) -> list:
    return spawn(roll_call_without_the_store_host, 2, timeout=60, may_exit=[0])


@background.fixture(waits=True)
def two_roll_calls(tmp_path_factory) -> list:
    return spawn(roll_call_answered, 2, timeout=60)


def test_stuck_peer_is_named_within_the_timeout(stuck_peer):
    message, seconds = stuck_peer
    assert message.startswith("rank 0 (ParallelMesh(pp=2, dp=1, tp=1, rank=0: pp_rank=0"), message
    assert "no answer from rank 1 (pp_rank=1, dp_rank=0, tp_rank=0) within 3s: it died or is stuck" in message, message
    assert "Timed out" in message, message
    assert seconds < 2 * TIMEOUT_S + 5, f"took {seconds:.1f}s with a {TIMEOUT_S}s timeout"


def step_with_a_dying_peer(victim: int) -> tuple[str, float]:
    """pp=2 x dp=2; rank ``victim`` exits in the middle of its first forward. Under spawn rank 0's
    process hosts the store (under torchrun the agent does): it stays until every survivor is done."""
    engine = tiny_engine(pp=2, dp=2)
    if dist.get_rank() == victim:
        engine.chunks[0].register_forward_hook(lambda *_: os._exit(1))
    out = failed_step(engine)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/done/{dist.get_rank()}", "")
    if dist.get_rank() == 0:
        store.wait([f"test/done/{r}" for r in range(4) if r != victim], timedelta(seconds=3 * TIMEOUT_S))
    return out


def test_dead_peer_is_named_by_every_survivor(dying_peer):
    out = dying_peer
    assert out[VICTIM] is None
    for rank in (0, 1, 3):
        message, seconds = out[rank]
        assert message.startswith(f"rank {rank} (ParallelMesh(pp=2, dp=2, tp=1, rank={rank}:"), message
        # the dead rank is named; a survivor still blocked in a collective that has not timed out yet
        # may be named with it (the message says so)
        named = re.search(r"no answer from (.*?) within", message)
        assert named and "rank 2 (pp_rank=1, dp_rank=0, tp_rank=0)" in named.group(1), message
        assert seconds < 2 * TIMEOUT_S + 5, f"rank {rank} took {seconds:.1f}s with a {TIMEOUT_S}s timeout"


def roll_call_without_the_store_host() -> str | None:
    init_mesh(timeout=timedelta(seconds=TIMEOUT_S))
    dist.barrier()
    if dist.get_rank() == 0:
        os._exit(1)  # takes the store (hosted in rank 0's process under spawn) with it
    time.sleep(1.0)
    start = time.monotonic()
    answer = roll_call(wait_s=2.0)
    assert time.monotonic() - start < 2.0 + 2, "the roll call outlasted its wait"
    return answer.describe()


def test_roll_call_reports_an_unreachable_store(store_host_gone):
    out = store_host_gone
    assert out[1].startswith("no roll call possible: the store at 127.0.0.1:"), out[1]
    assert "is unreachable, so its host died" in out[1], out[1]


def roll_call_answered() -> tuple[str, str]:
    init_mesh(timeout=timedelta(seconds=TIMEOUT_S))
    first = roll_call(wait_s=5.0).describe()
    second = roll_call(wait_s=1.0).describe() if dist.get_rank() == 0 else ""  # rank 1 never takes a 2nd call
    return first, second


def test_roll_call_counts_each_call_apart(two_roll_calls):
    (first, second), (other, _) = two_roll_calls
    assert first == other == "every rank answered a roll call within 5s"
    assert second.startswith("no answer from rank 1 within 1s"), second
    with pytest.raises(ValueError, match="wait_s must be > 0 seconds, got 0"):
        roll_call(wait_s=0)
