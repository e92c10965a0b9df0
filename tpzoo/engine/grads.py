"""Gradient norms and clipping over a model split across the ``pp x dp x tp`` mesh.

Each distinct gradient element counts exactly once in the global norm:

    tp shards (``facts(p).tp_split_dim`` set)   on every tp rank  (each holds different numbers)
    tp replicas (LayerNorm, row-parallel bias)  on tp rank 0 only (the others hold copies)
    ``facts(p).pp_tied`` (the word embedding tied across the first and last stage)
                                                on the first pipeline stage only
    dp replicas                                 not summed: after the gradient all-reduce every
                                                dp rank holds the same gradients (ZeRO-1 too)
    dp shards (``dp_sharded``: FSDP's Shard(0)   summed over dp too: each element is held by one dp rank
      pieces, ZeRO-2's owned gradients)
    expert weights (``facts(p).ep_split``)      summed over the ep group too (each ep rank holds other
                                                experts; its edp replicas the same ones): ep x edp = dp,
                                                so under ``dp_sharded`` the dp sum covers them

    ||g||^2 = all-reduce over tp and pp (and dp when ``dp_sharded``) of the local sum of squares, the experts'
              part first summed over ep (unless ``dp_sharded``)

A gradient may be a DTensor (FSDP's parameters are DTensors sharded over dp): its local shard is
what this rank holds and counts (``tpzoo.parallel.fsdp.local``).

The same counting gives the weights' norm (``global_params_norm``: ``--log-params-norm``; weights sharded
over dp by ZeRO's owners or FSDP summed over dp) and the zero entries of the reduced gradients
(``count_zero_grads``: ``--log-num-zeros-in-grad``).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tpzoo.parallel.fsdp import local
from tpzoo.parallel.mesh import ParallelMesh
from tpzoo.parallel.param_facts import facts


def _counted_here(p: nn.Parameter, mesh: ParallelMesh) -> bool:
    f = facts(p)
    if f.tp_split_dim is None and mesh.tp_rank != 0:
        return False
    return not (f.pp_tied and mesh.pp_rank != 0)


def local_grads(params: Iterable[nn.Parameter]) -> list[Tensor]:
    """The gradients of ``params`` that are set, as this rank's local tensors (DTensors' shards)."""
    return [local(p.grad) for p in params if p.grad is not None]


def _sum_over_mesh(value: Tensor, experts: Tensor, mesh: ParallelMesh, dp_sharded: bool) -> Tensor:
    """``value`` + ``experts`` (this rank's count of the elements it counts, of the other parameters and of the
    expert weights) summed over tp and pp, and dp when ``dp_sharded``, ``experts`` first over ep otherwise."""
    if mesh.ep_size > 1 and not dp_sharded:
        dist.all_reduce(experts, group=mesh.ep_group)
    value = value + experts
    for group in (mesh.tp_group, mesh.pp_group, *((mesh.fsdp_group,) if dp_sharded else ())):  # HSDP: shards
        if dist.get_world_size(group) > 1:
            dist.all_reduce(value, group=group)
    return value


def _split(params: Iterable[nn.Parameter], mesh: ParallelMesh) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The parameters of ``params`` this rank counts: (the others, the expert weights split over ep)."""
    counted = [p for p in params if _counted_here(p, mesh)]
    return [p for p in counted if not facts(p).ep_split], [p for p in counted if facts(p).ep_split]


def _sum_of_squares(tensors: list[Tensor], device: torch.device) -> Tensor:
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if tensors:
        sq = sq + torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]).square().sum()
    return sq


def global_grad_norm(params: Iterable[nn.Parameter], mesh: ParallelMesh, loss: torch.Tensor | None = None,
                     dp_sharded: bool = False) -> torch.Tensor:
    """The L2 norm (float32 scalar) of all gradients of the model that ``params`` are this rank's part of.
    ``loss``: a tensor whose non-finite entries (on any tp or pp rank) make the norm NaN on all of them,
    riding the norm's all-reduce (so the ranks agree on a non-finite loss at no extra collective).
    ``dp_sharded``: each dp rank holds a different part of the gradients (FSDP, ZeRO-2): summed over dp."""
    dense, experts = (_sum_of_squares(local_grads(group), mesh.device) for group in _split(params, mesh))
    if loss is not None:
        dense = dense + torch.where(torch.isfinite(loss).all(), 0.0, float("nan"))
    return _sum_over_mesh(dense, experts, mesh, dp_sharded).sqrt()


def global_params_norm(params: Iterable[nn.Parameter], mesh: ParallelMesh, dp_sharded: bool = False) -> Tensor:
    """The L2 norm (float32 scalar) of the weights of the whole model that ``params`` are this rank's part of,
    each weight counted once (as ``global_grad_norm`` counts gradients). ``dp_sharded``: each dp rank holds
    different weights (the ones it owns under ZeRO, FSDP's shards): summed over dp."""
    dense, experts = (_sum_of_squares([local(p.detach()) for p in group], mesh.device)
                      for group in _split(params, mesh))
    return _sum_over_mesh(dense, experts, mesh, dp_sharded).sqrt()


def count_zero_grads(params: Iterable[nn.Parameter], mesh: ParallelMesh, dp_sharded: bool = False) -> Tensor:
    """The number (int64 scalar) of zero entries of the gradients of the whole model, each counted once
    (the elements ``global_grad_norm`` counts; ``dp_sharded`` likewise). No host sync."""
    dense, experts = (sum(((g == 0).sum() for g in local_grads(group)), torch.zeros((), dtype=torch.int64,
                                                                                    device=mesh.device))
                      for group in _split(params, mesh))
    return _sum_over_mesh(dense, experts, mesh, dp_sharded)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, mesh: ParallelMesh,
                   loss: torch.Tensor | None = None, dp_sharded: bool = False) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / ||g||) with the global norm; return ||g|| (before clipping;
    NaN where ``loss`` is not finite; ``dp_sharded``: see ``global_grad_norm``).

    No host sync: the factor is a tensor, 1 where the norm is not finite (the gradients stay as they are
    and the caller skips the step) or ``max_norm`` is 0 (off).
    """
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, mesh, loss, dp_sharded)
    if max_norm > 0 and params:
        coef = torch.where(torch.isfinite(norm), (max_norm / (norm + 1e-6)).clamp(max=1.0), 1.0)
        torch._foreach_mul_(local_grads(params), coef)
    return norm


def any_nonfinite(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A float32 scalar tensor: 1 when any rank of ``group`` (default: the world) holds a non-finite
    gradient, else 0; the same on every rank (MAX all-reduce), so a step is skipped everywhere or nowhere.
    No host sync: the caller reads it with the step's other numbers."""
    params = list(params)
    grads = local_grads(params)
    # on the parameters' device even without gradients: nccl all-reduces only CUDA tensors
    bad = torch.zeros((), dtype=torch.float32, device=params[0].device if params else "cpu")
    if grads:
        bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float()
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bad
