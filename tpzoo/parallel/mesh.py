"""The process mesh ``pp x dp x cp x tp`` and the one place it is kept.

Ranks are laid out row-major over (pp, dp, cp, tp), tp innermost, so tensor-parallel peers
(the most talkative group) are adjacent ranks, i.e. on the same node. World size 8 with
tp=2, pp=2, dp=2 (cp 1):

    pp=0:  dp=0 -> ranks [0 1]   dp=1 -> ranks [2 3]      <- each [ ] is a tp group
    pp=1:  dp=0 -> ranks [4 5]   dp=1 -> ranks [6 7]

    tp groups: {0,1} {2,3} {4,5} {6,7}
    dp groups: {0,2} {1,3} {4,6} {5,7}   (same pp stage and tp rank: hold the same shard)
    pp groups: {0,4} {1,5} {2,6} {3,7}   (same dp replica and tp rank: one pipeline)

Context parallelism (``init_mesh(cp=)``, Megatron-LM's ``--context-parallel-size``) splits every sequence over the
cp ranks of a replica (``tpzoo.parallel.context_attention``): they hold the same weights, so gradients are summed,
and ZeRO and FSDP shard, over dp x cp together (``dp_cp_group``, one collective). World size 8, tp 2, dp 2, cp 2:

    cp groups    {0,2} {1,3} {4,6} {5,7}
    dp groups    {0,4} {1,5} {2,6} {3,7}        (the batch's rows are split over dp only)
    dp_cp groups {0,2,4,6} {1,3,5,7}            (the ranks holding the same tp shard)

Expert parallelism (``init_mesh(ep=)``, Megatron-LM's ``--expert-model-parallel-size``) is carved out of dp: the
dp ranks of a stage split into dp / ep expert-data-parallel replicas of ep consecutive dp ranks each, and a mixture
of experts' N experts spread over each ep group (``tpzoo.parallel.experts``). World size 8, tp 2, pp 1, dp 4, ep 2:

    dp groups  {0,2,4,6} {1,3,5,7}
    ep groups  {0,2} {4,6} {1,3} {5,7}       (consecutive dp ranks: together they hold every expert)
    edp groups {0,4} {2,6} {1,5} {3,7}       (hold the same experts: their gradients are summed over it)

``init_mesh`` builds it as a ``torch.distributed`` DeviceMesh and remembers it; layers and
models that are given no group ask ``get_mesh()``. Nothing else in tpzoo keeps global state.
"""

from __future__ import annotations

import atexit
import functools
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tpzoo.parallel.mesh_groups import DIMS, build_device_mesh, ep_edp_groups, flat_dp_cp_group, hsdp_groups
from tpzoo.parallel.random import RNGStatesTracker
from tpzoo.parallel.rollcall import PeerFailure, launch_store, roll_call
from tpzoo.testing import free_port

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass
class ParallelMesh:
    """A ``pp x dp x cp x tp`` DeviceMesh with the sizes, ranks and groups of each axis.

    Axes: ``pp`` pipeline stages (layers split into consecutive stages), ``dp`` data-parallel
    replicas (different micro-batches, gradients averaged), ``cp`` context-parallel pieces (each
    sequence split), ``tp`` tensor-parallel shards (each matrix multiply split). ``rng`` holds the
    dropout streams (see ``random``).
    """

    device_mesh: DeviceMesh
    device: torch.device
    rng: RNGStatesTracker = field(default_factory=RNGStatesTracker)
    expert_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None  # (ep, edp) when ep > 1
    dp_cp: dist.ProcessGroup | None = None  # dp x cp flattened, when cp > 1
    replicas: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None  # HSDP: dp's (replicate, shard) groups

    def size(self, dim: str) -> int:
        return self.device_mesh.size(DIMS.index(dim))

    def rank(self, dim: str) -> int:
        return self.device_mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(dim)

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def tp_rank(self) -> int:
        return self.rank("tp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def pp_size(self) -> int:
        return self.size("pp")

    @property
    def pp_rank(self) -> int:
        return self.rank("pp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.group("pp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.rank("dp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def cp_size(self) -> int:
        return self.size("cp")

    @property
    def cp_rank(self) -> int:
        return self.rank("cp")

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.group("cp")

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """The ranks holding the same weights (dp x cp; the dp group at cp 1): gradients are summed, ZeRO and FSDP
        shard, and the loss's parts are summed over it."""
        return self.dp_group if self.dp_cp is None else self.dp_cp

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp_size + self.cp_rank

    @functools.cached_property
    def dp_cp_mesh(self) -> DeviceMesh:
        """The dp_cp group as a 1-D DeviceMesh ("dp_cp"; the dp mesh at cp 1): FSDP shards over it."""
        if self.dp_cp is None:
            return self.device_mesh["dp"]
        ranks = torch.tensor(dist.get_process_group_ranks(self.dp_cp))
        return DeviceMesh.from_group(self.dp_cp, self.device_mesh.device_type, mesh=ranks, mesh_dim_names=("dp_cp",))

    @property
    def ep_size(self) -> int:
        return 1 if self.expert_groups is None else dist.get_world_size(self.expert_groups[0])

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The dp ranks among which a mixture of experts' experts are split (None when ep is 1)."""
        return None if self.expert_groups is None else self.expert_groups[0]

    @property
    def ep_rank(self) -> int:
        return 0 if self.expert_groups is None else dist.get_rank(self.expert_groups[0])

    @property
    def edp_group(self) -> dist.ProcessGroup:
        """The dp ranks holding the same experts (``dp_cp_group`` when ep is 1): expert gradients are summed over it."""
        return self.dp_cp_group if self.expert_groups is None else self.expert_groups[1]

    @property
    def fsdp_group(self) -> dist.ProcessGroup:
        """The ranks FSDP shards over: ``dp_cp_group``, or under HSDP (``init_mesh(dp_replicate=R)``) dp / R of them
        (the replicas hold the same shards)."""
        return self.dp_cp_group if self.replicas is None else self.replicas[1]

    @functools.cached_property
    def fsdp_mesh(self) -> DeviceMesh:
        """``dp_cp_mesh``, or under HSDP dp as a 2-D (replicate, shard) DeviceMesh: FSDP2 replicates over the first."""
        if self.replicas is None:
            return self.dp_cp_mesh
        ranks = self.device_mesh.mesh[self.pp_rank, :, 0, self.tp_rank].reshape(self.dp_replicate_size, -1)
        return DeviceMesh.from_group(list(self.replicas), self.device_mesh.device_type, mesh=ranks,
                                     mesh_dim_names=("replicate", "shard"))

    @property
    def dp_replicate_size(self) -> int:
        """HSDP's replica count (``init_mesh(dp_replicate=)``; 1 without HSDP)."""
        return dist.get_world_size(self.replicas[0]) if self.replicas else 1

    @functools.cached_property
    def tp_fsdp_mesh(self) -> DeviceMesh:
        """``tp_dp_mesh``, or under HSDP this pp stage's ranks as a 3-D (tp, replicate, shard) DeviceMesh."""
        if self.replicas is None:
            return self.tp_dp_mesh
        ranks = self.device_mesh.mesh[self.pp_rank, :, 0, :].reshape(self.dp_replicate_size, -1, self.tp_size)
        return DeviceMesh.from_group([self.tp_group, *self.replicas], self.device_mesh.device_type,
                                     mesh=ranks.permute(2, 0, 1), mesh_dim_names=("tp", "replicate", "shard"))

    @functools.cached_property
    def tp_dp_mesh(self) -> DeviceMesh:
        """This pp stage's ranks as a 2-D (tp, dp) DeviceMesh, tp first, its dp the dp_cp group: a tensor sharded on
        both (FSDP's or ZeRO's dp piece of a tp shard, ``tpzoo.checkpoint.tensors``) is the tp chunk, then the dp
        chunk of it."""
        ranks = self.device_mesh.mesh[self.pp_rank].reshape(-1, self.tp_size).T  # [dp, cp, tp] -> [tp, dp cp]
        return DeviceMesh.from_group([self.tp_group, self.dp_cp_group], self.device_mesh.device_type, mesh=ranks,
                                     mesh_dim_names=("tp", "dp"))

    @functools.cached_property
    def tp_ep_mesh(self) -> DeviceMesh:
        """This rank's tp and ep groups as a 2-D (tp, ep) DeviceMesh, tp first: an expert weight (the tp shard of this
        rank's experts) is the tp chunk, then the ep chunk (dim 0) of the full tensor (``tpzoo.checkpoint.tensors``).
        Only at ep > 1."""
        if self.expert_groups is None:
            raise RuntimeError("tp_ep_mesh: this mesh has no expert parallelism (ep 1)")
        ep_ranks = dist.get_process_group_ranks(self.ep_group)  # this tp rank's, ep position by position
        ranks = torch.tensor([[r - self.tp_rank + t for r in ep_ranks] for t in range(self.tp_size)])  # tp innermost
        return DeviceMesh.from_group([self.tp_group, self.ep_group], self.device_mesh.device_type, mesh=ranks,
                                     mesh_dim_names=("tp", "ep"))

    @functools.cached_property
    def edp_mesh(self) -> DeviceMesh:
        """The edp group as a 1-D DeviceMesh ("edp"; ``dp_cp_mesh`` at ep 1): FSDP shards the expert weights over
        it."""
        if self.expert_groups is None:
            return self.dp_cp_mesh
        ranks = torch.tensor(dist.get_process_group_ranks(self.edp_group))
        return DeviceMesh.from_group(self.edp_group, self.device_mesh.device_type, mesh=ranks, mesh_dim_names=("edp",))

    @functools.cached_property
    def tp_ep_edp_mesh(self) -> DeviceMesh:
        """This pp stage's ranks as a 3-D (tp, ep, edp) DeviceMesh: an expert weight's FSDP piece is the tp chunk, the
        ep chunk (dim 0: this ep rank's experts), then the edp chunk of that (dim 0 again). Only at ep > 1."""
        if self.expert_groups is None:
            raise RuntimeError("tp_ep_edp_mesh: this mesh has no expert parallelism (ep 1)")
        ranks = self.device_mesh.mesh[self.pp_rank].reshape(-1, self.ep_size, self.tp_size).permute(2, 1, 0)
        return DeviceMesh.from_group([self.tp_group, self.ep_group, self.edp_group], self.device_mesh.device_type,
                                     mesh=ranks, mesh_dim_names=("tp", "ep", "edp"))

    def __repr__(self) -> str:
        ep = f", ep={self.ep_size}" if self.ep_size > 1 else ""
        ep += f", dp_replicate={self.dp_replicate_size}" if self.replicas else ""
        cp, cp_rank = (f", cp={self.cp_size}", f", cp_rank={self.cp_rank}") if self.cp_size > 1 else ("", "")
        return (f"ParallelMesh(pp={self.pp_size}, dp={self.dp_size}{cp}, tp={self.tp_size}{ep}, "
                f"rank={dist.get_rank()}: pp_rank={self.pp_rank}, dp_rank={self.dp_rank}{cp_rank}, "
                f"tp_rank={self.tp_rank}, device={self.device})")


_mesh: ParallelMesh | None = None


def get_mesh() -> ParallelMesh:
    """The mesh made by the last ``init_mesh`` call."""
    if _mesh is None:
        raise RuntimeError("no parallel mesh: call tpzoo.parallel.init_mesh(tp=..., pp=...) first, "
                           "or pass the process group explicitly")
    return _mesh


def _check_size(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {name}={value}")


def mesh_shape(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1
               ) -> tuple[int, int, int]:
    """(pp, dp, tp) for ``world_size`` ranks of a mesh with ``cp`` context-parallel ranks, inferring dp; raises if
    the sizes do not fit."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp)):
        _check_size(name, value)
    named = f"tp x pp x cp = {tp} x {pp} x {cp}" if cp > 1 else f"tp x pp = {tp} x {pp}"
    if dp is None:
        if world_size % (tp * pp * cp):
            raise ValueError(f"world size {world_size} is not divisible by {named} = {tp * pp * cp}; "
                             f"launch a multiple of {tp * pp * cp} ranks or change the sizes")
        dp = world_size // (tp * pp * cp)
    if tp * pp * cp * dp != world_size:
        sizes = f"tp x pp x cp x dp = {tp} x {pp} x {cp} x {dp}" if cp > 1 else f"tp x pp x dp = {tp} x {pp} x {dp}"
        raise ValueError(f"{sizes} = {tp * pp * cp * dp} does not equal the world size {world_size}; launch "
                         f"{tp * pp * cp * dp} ranks or omit dp to infer it")
    return pp, dp, tp


def _start_process_group(device_type: str, timeout: timedelta) -> None:
    """Join torchrun's group (RANK etc. in the environment) or start a lone one-rank group."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timeout)
    # a script that never calls destroy_process_group (docs/checkpoints.md's example) left gloo's threads
    # to the interpreter's teardown, which aborted it once in CI ("terminate called without an active
    # exception", exit -6) after its last line had run; the gloo group this made is ended before that
    # (not nccl's: ending it at exit could wait on a collective stuck on a dead peer)
    if device_type != "cuda":
        atexit.register(_end_process_group)


def _end_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_ep(ep: int, dp: int, cp: int = 1) -> None:
    """ValueError unless the expert-parallel size ``ep`` divides ``dp`` (the experts' ranks are carved out of dp), and
    ep and context parallelism are not both asked for."""
    _check_size("ep", ep)
    if ep > 1 and cp > 1:
        raise ValueError(f"expert parallelism ep={ep} with context parallelism cp={cp}: tpzoo does not combine the "
                         f"two yet; choose one of them")
    if dp % ep:
        raise ValueError(f"expert parallelism ep={ep} must divide the data-parallel size dp={dp} (the expert ranks "
                         f"are carved out of dp); choose an ep dividing {dp}")


def init_mesh(tp: int = 1, pp: int = 1, dp: int | None = None, *, cp: int = 1, ep: int = 1, dp_replicate: int = 1,
              device_type: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> ParallelMesh:
    """Build the ``pp x dp x cp x tp`` mesh over all ranks and make it the current one.

    Starts the process group if none is running: under torchrun from its environment, else as a lone process (world
    size 1). Backend nccl for CUDA, gloo otherwise; ``device_type`` defaults to "cuda" when a GPU is visible.
    ``dp`` defaults to world_size / (tp x pp x cp). ``cp``: each sequence split over cp ranks (module docstring).
    ``ep``: experts split over groups of ep dp ranks (it must divide dp). ``dp_replicate``: HSDP, FSDP's shards over
    dp / dp_replicate ranks, replicated over dp_replicate groups of them (``fsdp_mesh``). ``timeout`` bounds every
    collective so that a dead peer ends the run with an error instead of a hang.
    """
    global _mesh
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp), ("ep", ep), ("dp_replicate", dp_replicate)):
        _check_size(name, value)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        # sizes that cannot fit fail before any connection: a rank that fails while its peers still
        # connect leaves them a gloo "connection closed by peer" error instead of the one line
        check_ep(ep, mesh_shape(int(os.environ.get("WORLD_SIZE", "1")), tp, pp, dp, cp)[1], cp)
    try:
        if not dist.is_initialized():
            _start_process_group(device_type, timeout)
        pp_, dp_, tp_ = mesh_shape(dist.get_world_size(), tp, pp, dp, cp)
        check_ep(ep, dp_, cp)
        shape = (pp_, dp_, cp, tp_)
        device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else \
            torch.device("cpu")
        _mesh = ParallelMesh(build_device_mesh(shape, device_type, timeout), device,
                             expert_groups=ep_edp_groups(shape, ep, timeout), dp_cp=flat_dp_cp_group(shape, timeout),
                             replicas=hsdp_groups(shape, dp_replicate, (cp, ep), timeout))
    except RuntimeError as e:  # a peer that never joined (stopped, dead): named by a roll call, as in a step
        store = launch_store()
        if store is None or isinstance(e, PeerFailure):
            raise
        who = roll_call(store=store).describe()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PeerFailure(f"rank {os.environ.get('RANK', '0')} failed in setting up the process groups: {who}; "
                          f"{first}") from e
    return _mesh
