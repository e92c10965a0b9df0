"""Run a function on N local gloo ranks, the way torchrun would, and never hang.

    results = spawn(check_layers, 4, tp=2)   # fn(*args, **kwargs) on ranks 0..3

Each rank is a fresh process with the caller's environment plus torchrun's (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so ``init_mesh`` takes its real torchrun path. ``fn`` must
be importable by name (a module-level function). The first rank that raises fails the whole call
with its rank and traceback; a rank that dies without a word (unless listed in ``may_exit``, for
tests of dying peers: its result is then None), or a run that outlasts ``timeout`` seconds, fails
it too, and every rank still running is killed.

Ranks are forked from a server process that imported torch and tpzoo's parallel layers, models, engine
and checkpoints once (multiprocessing "forkserver" with ``PRELOAD``): on 2 cores, 8 "spawn" processes each
importing torch.distributed's pipelining and optimizers took 35-40 s, 8 forks of the server 1 s. A fork
starts clean all the same: no process group, nothing run yet. Add to ``PRELOAD`` before the first call to
fork from a server that imported more (tests/conftest.py adds pytest and the suite's helpers).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Iterable

# modules, not packages: tpzoo's packages load their names on first use, so importing ``tpzoo.engine`` loads
# nothing heavy; these pull in torch.distributed's tensor, FSDP, checkpoint and pipelining code and dynamo, which
# every rank otherwise imported itself (2.3-3.3 s of CPU a rank, measured on 2 cores, 2026-11-28)
PRELOAD = ["torch", "tpzoo.parallel", "tpzoo.models.build", "tpzoo.models.families", "tpzoo.engine.train_step",
           "tpzoo.checkpoint"]


class DistributedTestError(RuntimeError):
    """A rank failed, died or timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, env: dict, args: tuple, kwargs: dict,
            results: Any) -> None:
    os.environ.clear()  # the server's environment is that of the first call: take the caller's
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        # pickled here, by value: the queue's pickler would pass a tensor's storage as a file descriptor that
        # this process shares only while it lives, and it may exit before the parent reads the result
        results.put((rank, "ok", pickle.dumps(fn(*args, **kwargs))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0, may_exit: Iterable[int] = (),
          **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results in rank order
    (None for a rank of ``may_exit`` that exited without reporting)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    may_exit = set(may_exit)
    if not may_exit <= set(range(world_size)):
        raise ValueError(f"may_exit={sorted(may_exit)} names ranks outside 0..{world_size - 1}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call of the process
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, dict(os.environ), args, kwargs, results),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    exited_at: dict[int, float] = {}  # a rank's result may still be in the pipe when it exits: allow 2 s
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None and now - exited_at.setdefault(r, now) > 2.0:
                        if r not in may_exit:
                            raise DistributedTestError(f"rank {r} exited with code {p.exitcode} without reporting")
                        out[r] = None
                if now > deadline:
                    waiting = [r for r in range(world_size) if r not in out]
                    raise DistributedTestError(f"timed out after {timeout:.0f}s; ranks {waiting} never finished")
                continue
            if status == "error":
                raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [out[r] for r in range(world_size)]
