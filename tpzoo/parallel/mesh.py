"""The 3D process mesh ``pp x dp x tp`` and the one place it is kept.

Ranks are laid out row-major over (pp, dp, tp), tp innermost, so tensor-parallel peers
(the most talkative group) are adjacent ranks, i.e. on the same node. World size 8 with
tp=2, pp=2, dp=2:

    pp=0:  dp=0 -> ranks [0 1]   dp=1 -> ranks [2 3]      <- each [ ] is a tp group
    pp=1:  dp=0 -> ranks [4 5]   dp=1 -> ranks [6 7]

    tp groups: {0,1} {2,3} {4,5} {6,7}
    dp groups: {0,2} {1,3} {4,6} {5,7}   (same pp stage and tp rank: hold the same shard)
    pp groups: {0,4} {1,5} {2,6} {3,7}   (same dp replica and tp rank: one pipeline)

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

from tpzoo.parallel.random import RNGStatesTracker
from tpzoo.parallel.rollcall import PeerFailure, launch_store, roll_call
from tpzoo.testing import free_port

DIMS = ("pp", "dp", "tp")
DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass
class ParallelMesh:
    """A ``pp x dp x tp`` DeviceMesh with the sizes, ranks and groups of each axis.

    Axes: ``pp`` pipeline stages (layers split into consecutive stages), ``dp`` data-parallel
    replicas (different micro-batches, gradients averaged), ``tp`` tensor-parallel shards
    (each matrix multiply split). ``rng`` holds the dropout streams (see ``random``).
    """

    device_mesh: DeviceMesh
    device: torch.device
    rng: RNGStatesTracker = field(default_factory=RNGStatesTracker)

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

    @functools.cached_property
    def tp_dp_mesh(self) -> DeviceMesh:
        """This pp stage's ranks as a 2-D (tp, dp) DeviceMesh, tp first: a tensor sharded on both (FSDP's
        dp piece of a tp shard, ``tpzoo.checkpoint.tensors``) is the tp chunk, then the dp chunk of it."""
        ranks = self.device_mesh.mesh[self.pp_rank].T  # [dp, tp] -> [tp, dp]
        return DeviceMesh.from_group([self.tp_group, self.dp_group], self.device_mesh.device_type, mesh=ranks,
                                     mesh_dim_names=("tp", "dp"))

    def __repr__(self) -> str:
        return (f"ParallelMesh(pp={self.pp_size}, dp={self.dp_size}, tp={self.tp_size}, "
                f"rank={dist.get_rank()}: pp_rank={self.pp_rank}, dp_rank={self.dp_rank}, "
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


def mesh_shape(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None) -> tuple[int, int, int]:
    """(pp, dp, tp) for ``world_size`` ranks, inferring dp; raises if the sizes do not fit."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        _check_size(name, value)
    if dp is None:
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not divisible by tp x pp = {tp} x {pp} = {tp * pp}; "
                             f"launch a multiple of {tp * pp} ranks or change tp/pp")
        dp = world_size // (tp * pp)
    if tp * pp * dp != world_size:
        raise ValueError(f"tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp} does not equal the world size "
                         f"{world_size}; launch {tp * pp * dp} ranks or omit dp to infer it")
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


def _build_device_mesh(shape: tuple[int, int, int], device_type: str, timeout: timedelta) -> DeviceMesh:
    """A DeviceMesh over explicitly made groups, one per axis slice, each with ``timeout``.

    Not ``init_device_mesh``: on gloo with torch 2.13 a process that made one aborts at exit
    ("terminate called without an active exception") in 3 to 6 runs of 8 even after
    ``destroy_process_group``; groups from ``new_group`` wrapped by ``from_group`` never did (0 of 24).
    """
    ranks = torch.arange(dist.get_world_size()).reshape(shape)
    mine = []
    for dim in range(len(shape)):
        for slice_ranks in ranks.movedim(dim, -1).reshape(-1, shape[dim]).tolist():
            group = dist.new_group(slice_ranks, timeout=timeout)  # collective: every rank makes every group
            if dist.get_rank() in slice_ranks:
                mine.append(group)
    return DeviceMesh.from_group(mine, device_type, mesh=ranks, mesh_dim_names=DIMS)


def init_mesh(tp: int = 1, pp: int = 1, dp: int | None = None, *, device_type: str | None = None,
              timeout: timedelta = DEFAULT_TIMEOUT) -> ParallelMesh:
    """Build the ``pp x dp x tp`` mesh over all ranks and make it the current one.

    Starts the process group if none is running: under torchrun from its environment, else as a
    lone process (world size 1). Backend nccl for CUDA, gloo otherwise; ``device_type`` defaults
    to "cuda" when a GPU is visible. ``dp`` defaults to world_size / (tp x pp). ``timeout`` bounds
    every collective so that a dead peer ends the run with an error instead of a hang.
    """
    global _mesh
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        _check_size(name, value)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        # sizes that cannot fit fail before any connection: a rank that fails while its peers still
        # connect leaves them a gloo "connection closed by peer" error instead of the one line
        mesh_shape(int(os.environ.get("WORLD_SIZE", "1")), tp, pp, dp)
    try:
        if not dist.is_initialized():
            _start_process_group(device_type, timeout)
        shape = mesh_shape(dist.get_world_size(), tp, pp, dp)
        device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else \
            torch.device("cpu")
        _mesh = ParallelMesh(_build_device_mesh(shape, device_type, timeout), device)
    except RuntimeError as e:  # a peer that never joined (stopped, dead): named by a roll call, as in a step
        store = launch_store()
        if store is None or isinstance(e, PeerFailure):
            raise
        who = roll_call(store=store).describe()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PeerFailure(f"rank {os.environ.get('RANK', '0')} failed in setting up the process groups: {who}; "
                          f"{first}") from e
    return _mesh
