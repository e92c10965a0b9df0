"""``save_checkpoint``: every rank writes its shards in parallel (torch.distributed.checkpoint) and
hashes them; rank 0 writes meta.json and the manifest and publishes the folder atomically (``paths``).
With ``background=True`` the hashing and the publication run on a thread while training goes on
(``wait_for_save`` joins it; the next save does first); with ``async_write=True`` too the writing of the
tensors, once copied out (torch.distributed.checkpoint's ``async_save``, its collectives on a gloo group of
their own: ``_writer_group``)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from tpzoo.checkpoint.manifest import MANIFEST_FILE, RANK0_FILES, PartError, merge_parts, write_manifest, write_part
from tpzoo.checkpoint.model import model_record
from tpzoo.checkpoint.optimizer import optimizer_entries, param_groups
from tpzoo.checkpoint.paths import (FORMAT, LATEST_FILE, META_FILE, VERSION, iteration_dir, partial_dir, publish,
                                   remove_leftovers)
from tpzoo.checkpoint.rng import rng_items
from tpzoo.checkpoint.tensors import model_entries, save_items
from tpzoo.engine.train_step import Engine
from tpzoo.parallel.health import peers_named
from tpzoo.parallel.lora import ADAPTER

logger = logging.getLogger(__name__)
RESERVED = ("iteration", "checkpoint")
FULL_BYTES = 64 << 20  # a disk with less free than this, after a write came up short, is full


def mesh_shape(engine: Engine) -> dict[str, int]:
    """The mesh's sizes (cp and ep only when > 1: the record of a run without them is unchanged)."""
    mesh = engine.mesh
    extra = {name: size for name, size in (("cp", mesh.cp_size), ("ep", mesh.ep_size)) if size > 1}
    return {"pp": mesh.pp_size, "dp": mesh.dp_size, "tp": mesh.tp_size, **extra}


def _meta(iteration: int, engine: Engine, meta: dict[str, Any], save_optimizer: bool, save_rng: bool,
          adapters_of: str | None = None) -> str:
    """meta.json's text: the caller's ``meta`` plus "iteration" and "checkpoint" (what loading needs;
    "optimizer"."saved" and "rng" say whether the optimizer state and the RNG states were written)."""
    taken = [k for k in RESERVED if k in meta]
    if taken:
        raise ValueError(f"meta keys {taken} are reserved for the checkpoint's own record; rename them")
    record = {
        "format": FORMAT, "version": VERSION, "mesh": mesh_shape(engine),
        "virtual_stages": engine.config.virtual_stages, "precision": engine.config.precision,
        "model": {**model_record(engine.chunks[0].model), **({"adapters_of": adapters_of} if adapters_of else {})},
        "optimizer": {"class": type(engine.optimizer).__name__,
                      "zero": engine.config.use_distributed_optimizer,
                      "param_groups": param_groups(engine.optimizer), "saved": save_optimizer},
        "rng": save_rng,
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "manifest": True,  # its absence then means damage, not a checkpoint from before manifests
    }
    try:
        return json.dumps({**meta, "iteration": iteration, "checkpoint": record}, indent=2) + "\n"
    except (TypeError, ValueError) as e:
        raise TypeError(f"meta must be JSON-able (numbers, strings, lists, dicts): {e}") from None


class CheckpointWriteError(OSError):
    """A save could not write its files (disk full, no permission, read-only, not a folder): the message
    names the folder and the error; ``latest`` still names the previous checkpoint."""


def _os_error(err: BaseException, folder: Path) -> OSError | None:
    """``err`` if an OSError, else the first OSError of DCP's CheckpointException (one failure per rank). torch's
    archive writer reports a write that came up short (a full disk) as a RuntimeError ("unexpected pos"): that
    is an OSError too, ENOSPC when the disk under ``folder`` has less than ``FULL_BYTES`` free."""
    causes = [exc for exc, _ in getattr(err, "failures", {}).values()] or [err]
    found = next((c for c in causes if isinstance(c, OSError)), None)
    if found is None and any("unexpected pos" in str(c) or "failed writing" in str(c) for c in causes):
        free = shutil.disk_usage(next(p for p in (folder, *folder.parents) if p.exists())).free
        found = (OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free:,} bytes free)") if free < FULL_BYTES
                 else OSError(errno.EIO, f"a write came up short ({free:,} bytes free)"))
    return found


def _write_error(folder: Path, cause: OSError) -> CheckpointWriteError:
    """The one-line error for ``cause``, a failed write into ``folder``."""
    what = f"[Errno {cause.errno}] {cause.strerror}" if cause.strerror else repr(cause)
    where = f" ({cause.filename})" if cause.filename else ""
    latest = folder.parent / LATEST_FILE
    try:
        kept = f"{latest} still names {latest.read_text().strip()}" if latest.is_file() else "no checkpoint was written"
    except OSError:  # the folder itself cannot be read
        kept = f"{latest} is unchanged"
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


@dataclass
class _Publication:
    """The last part of a save, on a thread: hash this rank's files; rank 0 then writes the manifest and
    publishes. ``failure``: (a write error?, the line every rank raises in ``wait_for_save``), and
    ``exception`` the error itself when it was not a write error."""

    final: Path
    started: float
    thread: threading.Thread | None = None
    failure: tuple[bool, str] | None = None
    exception: Exception | None = None

    def run(self, texts: dict[str, str], rank: int, world: int, timeout_s: float, written: Any = None) -> None:
        """``texts``: meta.json's and the caller's files (name -> text), written by rank 0; ``written``: the future
        of the tensors' background write (``async_write``), awaited first."""
        partial = partial_dir(self.final)
        try:
            if written is not None:
                _await_write(written, self.final)
            if rank == 0:
                for name, text in texts.items():
                    (partial / name).write_text(text)
            write_part(partial, rank, extra=[name for name in texts if name != META_FILE])
            if rank == 0:
                write_manifest(partial, merge_parts(partial, world, timeout_s), ())
                publish(partial, self.final)
                logger.info("saved checkpoint %s in %.2fs", self.final, time.perf_counter() - self.started)
        except OSError as e:
            self.failure = (True, str(_write_error(self.final, e)))
        except PartError:  # not published; the rank that failed says why
            pass
        except Exception as e:  # another rank's part never came, or a bug
            self.failure, self.exception = (False, f"{self.final}: rank {rank} failed: {e!r}"), e
        if self.failure and rank != 0:  # tell rank 0 at once, rather than after its timeout, if the disk lets us
            with contextlib.suppress(OSError):
                write_part(partial, rank, error=self.failure[1])


_pending: _Publication | None = None  # the save of this process still publishing
_writers: tuple[Any, dist.ProcessGroup] | None = None  # (the default group, the background writes' group of it)


def _writer_group(timeout_s: float) -> dist.ProcessGroup:
    """Collective at its first call: a gloo group of every rank for the collectives of the background writes
    (DCP's plan exchange), which run on a thread while training's collectives go on on the other groups."""
    global _writers
    default = dist.group.WORLD
    if _writers is None or _writers[0] is not default:  # one per process group (a test may start several)
        _writers = (default, dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
    return _writers[1]


class _Copied:
    """DCP's ``AsyncStager`` for a state dict whose tensors ``_copied`` already copied: handed over as it is.
    (DCP's own stager deep-copies each DTensor whole, and that fails for some of ours with "Attempted to call
    copy_() on an invalid python storage", measured with torch 2.13 at tp 2.)"""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor copied (a DTensor: its local shard, the same placements), so that the steps
    after the save cannot change what the background write reads."""
    def copy(t: Any) -> Any:
        if isinstance(t, DTensor):
            return DTensor.from_local(t.to_local().clone(), t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        return t.clone() if isinstance(t, torch.Tensor) else t
    return {key: copy(value) for key, value in state.items()}


def _await_write(written: Any, final: Path) -> None:
    """Wait for the background write ``written`` (DCP's future); a failed write as the OSError it was."""
    try:
        written.result()
    except (RuntimeError, CheckpointException) as e:
        cause = _os_error(e, final)
        if cause is None:
            raise
        raise cause from None


def wait_for_save() -> Path | None:
    """Collective: wait until the save started with ``background=True`` (if any) is published; its folder.
    A write error on any rank is a ``CheckpointWriteError`` on every rank (``latest`` then still names
    the checkpoint before it); another failure is raised as it is where it happened, a RuntimeError elsewhere.
    Every rank calls this alike: each has the same save pending, or none."""
    global _pending
    job, _pending = _pending, None
    if job is None:
        return None
    job.thread.join()
    failures: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    with peers_named(f"saving {job.final}"):  # a stuck or dead peer is named, as in a step
        dist.all_gather_object(failures, job.failure)
    if job.exception is not None:
        raise job.exception
    failed = next((f for f in failures if f), None)
    if failed:
        raise (CheckpointWriteError if failed[0] else RuntimeError)(failed[1])
    return job.final


def save_checkpoint(save_dir: str | Path, iteration: int, engine: Engine, *, meta: dict[str, Any],
                    background: bool = False, async_write: bool = False, save_optimizer: bool = True,
                    save_rng: bool = True, files: Mapping[str, str] | None = None,
                    adapters_of: str | None = None) -> Path:
    """Write ``save_dir/iter_{iteration:07d}/`` and point ``save_dir/latest`` at it; returns the folder.

    Collective: every rank of the engine's mesh calls it with the same arguments. Holds the model
    chunks' weights (float32: under bf16/fp16 the main weights, ``MainParams.weights``), the optimizer
    state (keyed by parameter name, sharded like the parameters; under ZeRO-1 each owner writes its
    part of both), the loss scaler, every rank's RNG states, and meta.json = ``meta``
    (JSON-able: model description, tokenizer, consumed_samples, scheduler state, args ...) with
    "iteration" and "checkpoint" added; last, manifest.json with every file's size and sha256 (each
    rank hashes the files it wrote). Written into ``iter_NNNNNNN.partial`` and renamed only once every
    rank has finished, so a save that fails leaves ``latest`` on the previous checkpoint (and its
    leftovers are removed by the next save). A file that cannot be written (disk full, permissions,
    ``save_dir`` a file) is a ``CheckpointWriteError`` naming the folder, on every rank.

    ``background``: return once the tensors are written (the engine may step on); the hashing, the
    manifest and the publication go on on a thread until ``wait_for_save`` (or the next save, which
    waits first). The tensors are copied out before this returns, so later steps cannot change them.
    ``async_write`` (--async-save): with ``background``, the tensors are written on a thread too, from a copy
    taken before this returns; the same files, and the same promises (a failed or killed write leaves ``latest``
    on the checkpoint before it).

    ``save_optimizer`` / ``save_rng`` False (Megatron-LM's --no-save-optim / --no-save-rng): the optimizer
    state (and loss scaler) / the RNG states are left out, and meta.json says so; loading such a
    checkpoint then needs ``load_optimizer=False`` / ``load_rng=False``.

    ``files``: text files to keep beside meta.json (name -> text; pretrain.py's config.toml), covered by the
    manifest like the rest.

    ``adapters_of``: the checkpoint (or model folder) the model's LoRA adapters were trained on: the model's
    weights are left out but for the adapters' (``tpzoo.parallel.lora``), and the model record names that base,
    which ``load_model`` loads first.
    """
    global _pending
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    if adapters_of and not getattr(engine.chunks[0].model, "adapters", None):
        raise ValueError(f"adapters_of={adapters_of!r}: the engine's model has no LoRA adapters to save alone")
    text = _meta(iteration, engine, meta, save_optimizer, save_rng, adapters_of)
    taken = [name for name in files or {} if name in (*RANK0_FILES, MANIFEST_FILE) or "/" in name or
             name.endswith((".distcp", ".part"))]
    if taken:
        raise ValueError(f"files {taken}: names of the checkpoint's own files or paths; name each a plain file name "
                         f"of its own")
    wait_for_save()
    engine.sync_replicas()  # local SGD between outer steps: the replicas' common weights, not one replica's
    start = time.perf_counter()
    final = iteration_dir(save_dir, iteration)
    partial = partial_dir(final)
    mesh = engine.mesh
    with peers_named(f"saving {final}", mesh, engine.config.timeout_s):  # a stuck or dead peer is named
        _on_first_rank(final, lambda: _prepare(final, partial))
        entries = [e for chunk in engine.chunks
                   for e in model_entries(chunk.model, mesh, weights=engine.main.weights(chunk.model))
                   if not adapters_of or f".{ADAPTER}.lora_" in e.key]
        entries += optimizer_entries(engine) if save_optimizer else []
        state, written = {**save_items(entries, mesh), **(rng_items(mesh) if save_rng else {})}, None
        try:
            if async_write:  # copied out now, written on a thread
                written = dcp.async_save(_copied(state), checkpoint_id=partial, async_stager=_Copied(),
                                         process_group=_writer_group(engine.config.timeout_s))
            else:
                dcp.save(state, checkpoint_id=partial)
        except (OSError, RuntimeError, CheckpointException) as e:
            cause = _os_error(e, final)
            if cause is None:
                raise
            raise _write_error(final, cause) from None
    _pending = job = _Publication(final, start)
    texts = {**(files or {}), META_FILE: text}
    job.thread = threading.Thread(target=job.run, args=(texts, dist.get_rank(), dist.get_world_size(),
                                                        engine.config.timeout_s, written), name=f"publish {final}",
                                  daemon=True)
    job.thread.start()
    if not background:
        wait_for_save()
    return final
