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
from contextlib import contextmanager, suppress
from typing import Iterator

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from tpzoo.parallel.mesh import ParallelMesh, get_mesh
from tpzoo.parallel.rollcall import DEFAULT_WAIT_S, PeerFailure, launch_store, roll_call

__all__ = ["PeerFailure", "peers_named", "roll_call"]


def _failure(e: BaseException) -> str:
    """The first line of a failed collective's error (DCP's CheckpointException: one rank's failure)."""
    if isinstance(e, CheckpointException):
        e = next((exc for exc, _ in e.failures.values()), e)
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@contextmanager
def peers_named(what: str, mesh: ParallelMesh | None = None, timeout_s: float = DEFAULT_WAIT_S) -> Iterator[None]:
    """Turn a RuntimeError inside (a failed collective) into a ``PeerFailure`` naming ``what`` failed on
    this rank and the ranks a roll call (waiting ``min(DEFAULT_WAIT_S, timeout_s)``) found missing, with
    their coordinates in ``mesh`` (default: the current one, if any)."""
    try:
        yield
    except PeerFailure:
        raise
    except (RuntimeError, CheckpointException) as e:  # DCP's collectives fail as a CheckpointException
        if mesh is None:
            with suppress(RuntimeError):
                mesh = get_mesh()
        wait_s = min(DEFAULT_WAIT_S, timeout_s)
        store = None if dist.is_initialized() else launch_store(wait_s)  # the groups are being made
        if store is None and not dist.is_initialized():
            raise
        who = roll_call(wait_s, store).describe(mesh)
        where = f" ({mesh!r})" if mesh is not None else ""
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        raise PeerFailure(f"rank {rank}{where} failed in {what}: {who}; {_failure(e)}") from e
