"""The roll call that names which peer is gone after a collective fails (``tpzoo.parallel.health`` for how it is
used): each surviving rank answers over a store and waits a few seconds for the others; the ranks whose answer
did not come died or are stuck. Below the mesh: ``init_mesh`` takes one over the launcher's store (``launch_store``)
when the process groups cannot be made.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

PREFIX = "tpzoo/rollcall"
DEFAULT_WAIT_S = 5.0


@dataclass
class RollCall:
    """The outcome of one roll call: the ranks that did not answer, or why the store could not be asked."""

    missing: list[int]          # ranks (of the default group) whose answer did not come within wait_s
    wait_s: float
    store_error: str | None = None  # the store was unreachable: its error (``missing`` is then empty)

    def describe(self, mesh: Any = None) -> str:
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


def _coordinates(mesh: Any, rank: int) -> str:
    """'pp_rank=1, dp_rank=0, tp_rank=0' of ``rank`` in ``mesh`` (a ``ParallelMesh``: its axes by name)."""
    where = (mesh.device_mesh.mesh == rank).nonzero()
    if not len(where):
        return "not in the mesh"
    dims = zip(mesh.device_mesh.mesh_dim_names, where[0].tolist(), mesh.device_mesh.mesh.shape)
    return ", ".join(f"{dim}_rank={i}" for dim, i, size in dims if size > 1 or dim != "cp")  # cp only when used


def roll_call(wait_s: float = DEFAULT_WAIT_S, store: dist.Store | None = None) -> RollCall:
    """Answer a roll call and wait up to ``wait_s`` seconds for the other ranks of the default group; ``store``:
    another store than the default group's (``launch_store``: while the groups are being made), the ranks then
    from the environment."""
    if wait_s <= 0:
        raise ValueError(f"wait_s must be > 0 seconds, got {wait_s}")
    if store is None and not dist.is_initialized():
        raise RuntimeError("roll_call needs a running process group (init_mesh or init_process_group) or a store")
    if store is None:
        store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
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


def launch_store(wait_s: float = DEFAULT_WAIT_S) -> dist.Store | None:
    """A client of the launcher's store (``MASTER_ADDR``:``MASTER_PORT``, torchrun's agent's) for a roll call
    before the default group exists, or None where none answers (a lone process, whose rank 0 hosts it)."""
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=wait_s))
    except (KeyError, ValueError, RuntimeError):
        return None
