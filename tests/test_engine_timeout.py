"""A stuck peer ends a training step with an error that names the rank that saw it, within the timeout."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.train_step import Engine
from tpzoo.models import GPTModel, get_preset
from tpzoo.parallel import init_mesh
from tpzoo.testing import spawn

TIMEOUT_S = 3.0


def step_with_a_stuck_peer() -> tuple[str, float] | None:
    mesh = init_mesh(pp=2, timeout=timedelta(seconds=TIMEOUT_S))
    config = get_preset("gpt-tiny", num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=101,
                        max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0)
    engine = Engine(lambda **stage: GPTModel(config, mesh, **stage), config,
                    EngineConfig(micro_batch_size=1, global_batch_size=2, timeout_s=TIMEOUT_S), mesh)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    if dist.get_rank() == 1:
        time.sleep(3 * TIMEOUT_S)  # alive, but never joins the step
        return None
    start = time.monotonic()
    try:
        engine.train_step(dict(input_ids=ids, labels=ids))
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    raise AssertionError("the step finished without its peer")


def test_stuck_peer_fails_with_rank_and_timeout():
    message, seconds = spawn(step_with_a_stuck_peer, 2, timeout=120)[0]
    assert message.startswith("rank 0 (ParallelMesh(pp=2, dp=1, tp=1, rank=0: pp_rank=0"), message
    assert "Timed out" in message, message
    assert seconds < 2 * TIMEOUT_S + 5, f"took {seconds:.1f}s with a {TIMEOUT_S}s timeout"
