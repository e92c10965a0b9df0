"""The process groups of a mesh's axes (``tpzoo.parallel.mesh.init_mesh``): every rank makes every group, in the
same order (``new_group`` is collective), each with the mesh's timeout."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "dp", "cp", "tp")


def axis_groups(ranks: torch.Tensor, timeout: timedelta, dims: tuple[int, ...] | None = None
                 ) -> list[dist.ProcessGroup]:
    """This rank's group along each axis (of ``dims``, default all) of ``ranks`` (the world's ranks laid out on a
    grid), each with ``timeout``: every rank makes every group (``new_group`` is collective)."""
    mine = []
    for dim in range(ranks.dim()) if dims is None else dims:
        for slice_ranks in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
            group = dist.new_group(slice_ranks, timeout=timeout)
            if dist.get_rank() in slice_ranks:
                mine.append(group)
    return mine


def build_device_mesh(shape: tuple[int, int, int, int], device_type: str, timeout: timedelta) -> DeviceMesh:
    """A DeviceMesh over explicitly made groups, one per axis slice, each with ``timeout``.

    Not ``init_device_mesh``: on gloo with torch 2.13 a process that made one aborts at exit
    ("terminate called without an active exception") in 3 to 6 runs of 8 even after
    ``destroy_process_group``; groups from ``new_group`` wrapped by ``from_group`` never did (0 of 24).
    """
    ranks = torch.arange(dist.get_world_size()).reshape(shape)
    return DeviceMesh.from_group(axis_groups(ranks, timeout), device_type, mesh=ranks, mesh_dim_names=DIMS)


def flat_dp_cp_group(shape: tuple[int, int, int, int], timeout: timedelta) -> dist.ProcessGroup | None:
    """This rank's group of dp x cp flattened (the ranks of its pp stage and tp rank); None at cp 1."""
    pp, dp, cp, tp = shape
    if cp == 1:
        return None
    return axis_groups(torch.arange(dist.get_world_size()).reshape(pp, dp * cp, tp), timeout, dims=(1,))[0]


def ep_edp_groups(shape: tuple[int, int, int, int], ep: int, timeout: timedelta
                   ) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
    """(ep group, edp group) of this rank: the dp axis of (pp, dp, tp) split into (edp, ep), ep inner; None at ep 1."""
    if ep == 1:
        return None
    pp, dp, _, tp = shape
    ranks = torch.arange(dist.get_world_size()).reshape(pp, dp // ep, ep, tp)
    edp_group, ep_group = axis_groups(ranks, timeout, dims=(1, 2))
    return ep_group, edp_group


def hsdp_groups(shape: tuple[int, int, int, int], replicate: int, dp_ep: tuple[int, int], timeout: timedelta
                ) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
    """HSDP's (replicate, shard) groups of this rank: the dp axis split into (replicate, dp / replicate), shard inner;
    None at 1. ValueError unless ``replicate`` divides dp, at cp 1 and ep 1 (``dp_ep``: the cp and ep sizes)."""
    pp, dp, _, tp = shape
    if replicate == 1:
        return None
    if dp % replicate or dp_ep != (1, 1):
        raise ValueError(f"dp_replicate={replicate} (HSDP) must divide dp={dp}, at cp 1 and ep 1 (cp, ep = {dp_ep}); "
                         f"choose a divisor of {dp} or drop it")
    ranks = torch.arange(dist.get_world_size()).reshape(pp, replicate, dp // replicate, tp)
    replicate_group, shard_group = axis_groups(ranks, timeout, dims=(1, 2))
    return replicate_group, shard_group
