"""``save_checkpoint``: every rank writes its shards in parallel (torch.distributed.checkpoint), then
rank 0 publishes the folder atomically (``paths``)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tpzoo.checkpoint.model import model_record
from tpzoo.checkpoint.optimizer import optimizer_entries, param_groups
from tpzoo.checkpoint.paths import FORMAT, META_FILE, VERSION, iteration_dir, partial_dir, publish, remove_leftovers
from tpzoo.checkpoint.rng import rng_items
from tpzoo.checkpoint.tensors import model_entries, save_items
from tpzoo.engine.train_step import Engine

logger = logging.getLogger(__name__)
RESERVED = ("iteration", "checkpoint")


def mesh_shape(engine: Engine) -> dict[str, int]:
    return {"pp": engine.mesh.pp_size, "dp": engine.mesh.dp_size, "tp": engine.mesh.tp_size}


def _meta(iteration: int, engine: Engine, meta: dict[str, Any]) -> str:
    """meta.json's text: the caller's ``meta`` plus "iteration" and "checkpoint" (what loading needs)."""
    taken = [k for k in RESERVED if k in meta]
    if taken:
        raise ValueError(f"meta keys {taken} are reserved for the checkpoint's own record; rename them")
    record = {
        "format": FORMAT, "version": VERSION, "mesh": mesh_shape(engine),
        "virtual_stages": engine.config.virtual_stages, "precision": engine.config.precision,
        "model": model_record(engine.chunks[0].model),
        "optimizer": {"class": type(engine.optimizer).__name__,
                      "zero": engine.config.use_distributed_optimizer,
                      "param_groups": param_groups(engine.optimizer)},
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
    }
    try:
        return json.dumps({**meta, "iteration": iteration, "checkpoint": record}, indent=2) + "\n"
    except (TypeError, ValueError) as e:
        raise TypeError(f"meta must be JSON-able (numbers, strings, lists, dicts): {e}") from None


def save_checkpoint(save_dir: str | Path, iteration: int, engine: Engine, *, meta: dict[str, Any]) -> Path:
    """Write ``save_dir/iter_{iteration:07d}/`` and point ``save_dir/latest`` at it; returns the folder.

    Collective: every rank of the engine's mesh calls it with the same arguments. Holds the model
    chunks' weights (float32: under bf16/fp16 the main weights, ``MainParams.weights``), the optimizer
    state (keyed by parameter name, sharded like the parameters; under ZeRO-1 each owner writes its
    part of both), the loss scaler, every rank's RNG states, and meta.json = ``meta``
    (JSON-able: model description, tokenizer, consumed_samples, scheduler state, args ...) with
    "iteration" and "checkpoint" added. Written into ``iter_NNNNNNN.partial`` and renamed only
    once every rank has finished, so a save that fails leaves ``latest`` on the previous checkpoint
    (and its leftovers are removed by the next save).
    """
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    text = _meta(iteration, engine, meta)
    start = time.perf_counter()
    final = iteration_dir(save_dir, iteration)
    partial = partial_dir(final)
    first = dist.get_rank() == 0
    if first:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(final.parent)
        partial.mkdir()
    dist.barrier()
    mesh = engine.mesh
    entries = [e for chunk in engine.chunks
               for e in model_entries(chunk.model, mesh, weights=engine.main.weights(chunk.model))]
    entries += optimizer_entries(engine)
    dcp.save({**save_items(entries, mesh), **rng_items(mesh)}, checkpoint_id=partial)
    if first:
        (partial / META_FILE).write_text(text)
        publish(partial, final)
    dist.barrier()
    if first:
        logger.info("saved checkpoint %s in %.2fs", final, time.perf_counter() - start)
    return final
