"""``--fault-tolerance``: pretrain.py's launch as one replica group of torchft's per-step fault tolerance
(``tpzoo.engine.fault_tolerance``; docs/elastic.md). Each group is its own launch (torchrun) of the same flags but
``--ft-replica-id``, with its own ``--save`` folder; the groups meet at torchft's lighthouse ($TORCHFT_LIGHTHOUSE).

    replicas = join_replica_groups(job.parallel, mesh)   # before the run is built: this group heartbeats from now on
    run = build_run(..., replicas=replicas)
    share_run_state(replicas, run)                      # what a returning group copies from a live one
    line = rejoin(run)                                  # before each step (the loop): the quorum, healing if behind

A group behind the others (started again, or resumed from an older checkpoint) receives from a live group, rank by
rank, its weights, optimizer state, loss scale and data position (iteration, consumed samples, the lr schedule's
place), and then steps with it: from there the groups hold the same weights bit for bit.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tpzoo.checkpoint.peer import load_peer_state, peer_state
from tpzoo.engine.fault_tolerance import ReplicaGroups
from tpzoo.parallel import ParallelMesh
from tpzoo.training.parallel_config import ParallelConfig
from tpzoo.training.setup import Run

COUNTERS = ("iteration", "consumed_samples", "lr_steps")  # a run's data position and lr schedule place


def join_replica_groups(parallel: ParallelConfig, mesh: ParallelMesh) -> ReplicaGroups:
    """This launch's replica group (``--ft-replica-id`` of ``--ft-replica-groups``): torchft's manager on every rank,
    over a process group of its own that pairs rank r with rank r of the other groups (gloo on a CPU, NCCL on CUDA);
    rank 0 reports to the lighthouse. Collective over the group's ranks."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager logs every step at INFO otherwise
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    # a peer's state arrives in read-only buffers that load_peer_state only copies from
    warnings.filterwarnings("ignore", message="The given buffer is not writable")

    timeout = parallel.timeout
    group = ProcessGroupNCCL(timeout=timeout) if mesh.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=group, load_state_dict=None, state_dict=None, min_replica_size=parallel.ft_min_replicas,
                      use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
                      connect_timeout=timedelta(seconds=60), rank=dist.get_rank(), world_size=dist.get_world_size(),
                      lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
                      replica_id=f"tpzoo_replica_{parallel.ft_replica_id}")
    return ReplicaGroups(manager, parallel.ft_replica_id, parallel.ft_replica_groups)


def share_run_state(replicas: ReplicaGroups | None, run: Run) -> Run:
    """Register with torchft what a returning group copies from ``run``'s group (module docstring), and start the
    count of steps at the run's iteration (a resumed group is behind only by the steps since its checkpoint); ``run``.
    Nothing without ``replicas``."""
    if replicas is None:
        return run

    def state() -> dict[str, Any]:
        return dict(engine=peer_state(run.engine), run={name: getattr(run, name) for name in COUNTERS})

    def load(received: dict[str, Any]) -> None:  # published by ``rejoin`` once every rank of the group has it
        load_peer_state(run.engine, received["engine"], publish=False)
        for name in COUNTERS:
            setattr(run, name, received["run"][name])

    replicas.manager.register_state_dict_fn("tpzoo", load, state)
    replicas.manager.load_state_dict({"step": run.iteration, "batches_committed": 0})
    return run


def rejoin(run: Run) -> str | None:
    """Before a step: torchft's quorum (``ReplicaGroups.begin``); the line to log when this group was behind and
    took a live group's state, else None. RuntimeError when some ranks of the group took it and others failed to
    (their iterations differ): the group stops, for its launcher to start it again."""
    before = run.iteration
    run.engine.replicas.begin()
    reached = torch.tensor([run.iteration, -run.iteration], dtype=torch.float64, device=run.mesh.device)
    dist.all_reduce(reached, op=dist.ReduceOp.MAX)  # over this group's ranks
    if reached[0] != -reached[1]:
        raise RuntimeError(f"replica group {run.engine.replicas.index}: its ranks are at iterations "
                           f"{-reached[1]:.0f} to {reached[0]:.0f} after taking a live group's state (a rank failed "
                           f"to receive it); stopping so that the group starts again")
    if run.iteration == before:
        return None
    run.engine.main.publish()
    return (f"replica group {run.engine.replicas.index} recovered from a live group: iteration {run.iteration} (it "
            f"was at {before}), with its weights, optimizer state and data position; "
            f"{run.engine.replicas.live} groups live")
