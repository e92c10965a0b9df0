"""Which peer is gone: a roll call over the default process group's store after a collective fails.

A timeout, or gloo's "Connection closed by peer", tells a rank that a collective failed, not which
peer is dead. Each surviving rank then calls ``roll_call`` (once per failure):

    1. n = 1 + the roll calls this rank took before (a counter in the store): the n-th roll call of
       every rank meets the n-th of the others
    2. set ``tpzoo/rollcall/<n>/<rank>`` and count itself in ``tpzoo/rollcall/<n>/count``
    3. wait up to ``wait_s`` for the count to reach the world size; the ranks whose key is then
       missing did not answer: they died, or are stuck (alive, but not running this code: in a
       loop, or blocked in a collective that has not timed out yet)

The store is not part of the collectives: torchrun's agent hosts it, or under ``tpzoo.testing.spawn``
(and any launch where torchrun's agent does not) rank 0's process, in a thread that answers while
rank 0's main thread is blocked. When it cannot be reached (its host died), the roll call says so
instead of naming ranks. Every store operation is bounded by ``wait_s`` (a few seconds, and never
more than the process groups' timeout: the caller picks it), so the roll call itself cannot hang.

    except RuntimeError as e:
        who = roll_call(wait_s=5.0).describe(mesh)
        raise RuntimeError(f"rank {dist.get_rank()} failed: {who}; {e}") from e

or, around any code that runs collectives, ``with peers_named("train_step", mesh, timeout_s):``, which
does that once: a ``PeerFailure`` (already named) passes through an outer ``peers_named`` untouched,
so the ranks' n-th roll calls still meet. Within the process groups' timeout (the collective's wait)
plus ``min(DEFAULT_WAIT_S, timeout)`` every surviving rank has named the stuck or dead ones.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch.distributed as dist

from tpzoo.parallel.mesh import DIMS, ParallelMesh, get_mesh

PREFIX = "tpzoo/rollcall"
DEFAULT_WAIT_S = 5.0


@dataclass
class RollCall:
    """The outcome of one roll call: the ranks that did not answer, or why the store could not be asked."""

    missing: list[int]          # ranks (of the default group) whose answer did not come within wait_s
    wait_s: float
    store_error: str | None = None  # the store was unreachable: its error (``missing`` is then empty)

    def describe(self, mesh: ParallelMesh | None = None) -> str:
        """One sentence for an error message, naming each missing rank with its mesh coordinates."""
        if self.store_error is not None:
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return (f"no roll call possible: the store at {where} is unreachable, so its host died (rank 0, or "
                    f"torchrun's agent) ({self.store_error})")
        if not self.missing:
            return f"every rank answered a roll call within {self.wait_s:g}s"
        names = ", ".join(f"rank {r}" + (f" ({_coordinates(mesh, r)})" if mesh is not None else "")
                          for r in self.missing)
        it = "it" if len(self.missing) == 1 else "each"
        return (f"no answer from {names} within {self.wait_s:g}s: {it} died or is stuck (a rank blocked in a "
                f"collective answers only once that times out)")


def _coordinates(mesh: ParallelMesh, rank: int) -> str:
    """'pp_rank=1, dp_rank=0, tp_rank=0' of ``rank`` in ``mesh`` (laid out (pp, dp, tp))."""
    where = (mesh.device_mesh.mesh == rank).nonzero()
    if not len(where):
        return "not in the mesh"
    return ", ".join(f"{dim}_rank={i}" for dim, i in zip(DIMS, where[0].tolist()))


def roll_call(wait_s: float = DEFAULT_WAIT_S) -> RollCall:
    """Answer a roll call and wait up to ``wait_s`` seconds for the other ranks of the default group."""
    if wait_s <= 0:
        raise ValueError(f"wait_s must be > 0 seconds, got {wait_s}")
    if not dist.is_initialized():
        raise RuntimeError("roll_call needs a running process group (init_mesh or init_process_group)")
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    before = store.timeout
    store.set_timeout(timedelta(seconds=wait_s))
    try:
        n = store.add(f"{PREFIX}/calls/{rank}", 1)
        store.set(f"{PREFIX}/{n}/{rank}", "here")
        count, deadline = store.add(f"{PREFIX}/{n}/count", 1), time.monotonic() + wait_s
        while count < world and time.monotonic() < deadline:
            time.sleep(0.05)
            count = store.add(f"{PREFIX}/{n}/count", 0)  # one request a poll, whatever the world size
        missing = [r for r in range(world) if not store.check([f"{PREFIX}/{n}/{r}"])]
    except RuntimeError as e:  # DistStoreError, DistNetworkError: the store's host is gone or hangs
        return RollCall([], wait_s, store_error=str(e).splitlines()[0])
    finally:
        store.set_timeout(before)  # a client setting: no request
    return RollCall(missing, wait_s)


class PeerFailure(RuntimeError):
    """A collective failed and a roll call named the missing ranks (the message says which)."""


@contextmanager
def peers_named(what: str, mesh: ParallelMesh | None = None, timeout_s: float = DEFAULT_WAIT_S) -> Iterator[None]:
    """Turn a RuntimeError inside (a failed collective) into a ``PeerFailure`` naming ``what`` failed on
    this rank and the ranks a roll call (waiting ``min(DEFAULT_WAIT_S, timeout_s)``) found missing, with
    their coordinates in ``mesh`` (default: the current one, if any)."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as e:
        if mesh is None:
            with suppress(RuntimeError):
                mesh = get_mesh()
        who = roll_call(min(DEFAULT_WAIT_S, timeout_s)).describe(mesh)
        where = f" ({mesh!r})" if mesh is not None else ""
        raise PeerFailure(f"rank {dist.get_rank()}{where} failed in {what}: {who}; {e}") from e
