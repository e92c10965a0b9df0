"""``save_checkpoint``: every rank writes (and hashes) its shards in parallel (torch.distributed.checkpoint),
then rank 0 writes meta.json and the manifest and publishes the folder atomically (``paths``)."""

from __future__ import annotations

import errno
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tpzoo.checkpoint.manifest import HashingWriter, gather_hashes, write_manifest
from tpzoo.checkpoint.model import model_record
from tpzoo.checkpoint.optimizer import optimizer_entries, param_groups
from tpzoo.checkpoint.paths import (FORMAT, LATEST_FILE, META_FILE, VERSION, iteration_dir, partial_dir, publish,
                                   remove_leftovers)
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


class CheckpointWriteError(OSError):
    """A save could not write its files (disk full, no permission, read-only, not a folder): the message
    names the folder and the error; ``latest`` still names the previous checkpoint."""


def _os_error(err: BaseException) -> OSError | None:
    """``err`` if an OSError, else the first OSError of DCP's CheckpointException (one failure per rank)."""
    causes = [exc for exc, _ in getattr(err, "failures", {}).values()] or [err]
    return next((c for c in causes if isinstance(c, OSError)), None)


def _write_error(folder: Path, cause: OSError) -> CheckpointWriteError:
    """The one-line error for ``cause``, a failed write into ``folder``."""
    what = f"[Errno {cause.errno}] {cause.strerror}" if cause.strerror else repr(cause)
    where = f" ({cause.filename})" if cause.filename else ""
    latest = folder.parent / LATEST_FILE
    kept = f"{latest} still names {latest.read_text().strip()}" if latest.is_file() else "no checkpoint was written"
    return CheckpointWriteError(f"cannot write checkpoint {folder}: {what}{where}; {kept} (free space or fix the "
                                f"folder's permissions, or pass another --save)")


def _on_first_rank(final: Path, action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0. If it fails every rank raises (the others would wait for rank 0 forever):
    ``CheckpointWriteError`` for an OSError, else rank 0 its exception and the others a RuntimeError."""
    told: list[tuple[bool, str] | None] = [None]  # (a write error?, message)
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            action()
        except Exception as e:
            written = isinstance(e, OSError)
            error = _write_error(final, e) if written else e
            told[0] = (written, str(error) if written else f"{final}: rank 0 failed: {e!r}")
    dist.broadcast_object_list(told, src=0)
    if error is not None:
        raise error
    if told[0] is not None:
        raise (CheckpointWriteError if told[0][0] else RuntimeError)(told[0][1])


def _prepare(final: Path, partial: Path) -> None:
    if final.parent.exists() and not final.parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(final.parent))
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(final.parent)
    partial.mkdir()


def _finish(partial: Path, final: Path, text: str, files: dict[str, dict[str, Any]]) -> None:
    (partial / META_FILE).write_text(text)
    write_manifest(partial, files, (META_FILE,))
    publish(partial, final)


def save_checkpoint(save_dir: str | Path, iteration: int, engine: Engine, *, meta: dict[str, Any]) -> Path:
    """Write ``save_dir/iter_{iteration:07d}/`` and point ``save_dir/latest`` at it; returns the folder.

    Collective: every rank of the engine's mesh calls it with the same arguments. Holds the model
    chunks' weights (float32: under bf16/fp16 the main weights, ``MainParams.weights``), the optimizer
    state (keyed by parameter name, sharded like the parameters; under ZeRO-1 each owner writes its
    part of both), the loss scaler, every rank's RNG states, and meta.json = ``meta``
    (JSON-able: model description, tokenizer, consumed_samples, scheduler state, args ...) with
    "iteration" and "checkpoint" added; last, manifest.json with every file's size and sha256 (each
    rank hashes the shards it writes as it writes them). Written into ``iter_NNNNNNN.partial`` and
    renamed only once every rank has finished, so a save that fails leaves ``latest`` on the previous
    checkpoint (and its leftovers are removed by the next save). A file that cannot be written (disk
    full, permissions, ``save_dir`` a file) is a ``CheckpointWriteError`` naming the folder, on every rank.
    """
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    text = _meta(iteration, engine, meta)
    start = time.perf_counter()
    final = iteration_dir(save_dir, iteration)
    partial = partial_dir(final)
    _on_first_rank(final, lambda: _prepare(final, partial))
    mesh = engine.mesh
    entries = [e for chunk in engine.chunks
               for e in model_entries(chunk.model, mesh, weights=engine.main.weights(chunk.model))]
    entries += optimizer_entries(engine)
    writer = HashingWriter(partial)
    try:
        dcp.save({**save_items(entries, mesh), **rng_items(mesh)}, storage_writer=writer)
    except (OSError, CheckpointException) as e:
        cause = _os_error(e)
        if cause is None:
            raise
        raise _write_error(final, cause) from None
    files = gather_hashes(writer.hashes)
    _on_first_rank(final, lambda: _finish(partial, final, text, files))
    if dist.get_rank() == 0:
        logger.info("saved checkpoint %s in %.2fs", final, time.perf_counter() - start)
    return final
