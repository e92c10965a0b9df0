"""The conjugate collectives of tensor and sequence parallelism, as autograd functions.

Each forward communication has a conjugate backward (Megatron-LM, Shoeybi et al. 2019, sec. 3):

    function                                  forward                    backward
    copy_to_tp_region            (f)          identity                   all-reduce
    reduce_from_tp_region        (g)          all-reduce                 identity
    scatter_to_tp_region                      split last dim             all-gather last dim
    gather_from_tp_region                     all-gather last dim        split last dim
    scatter_to_sequence_parallel_region       split seq dim              all-gather seq dim
    gather_from_sequence_parallel_region      all-gather seq dim         reduce-scatter seq dim
    reduce_scatter_to_sequence_parallel_region reduce-scatter seq dim    all-gather seq dim

Activations are batch-first ``[b, s, h]``, so the sequence dim is 1 by default. A split keeps
rank r's chunk ``r*n/tp ... (r+1)*n/tp``; the dim must divide by tp. ``group=None`` means the
tp group of the current mesh. With one rank every function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tpzoo.parallel.mesh import get_mesh

SEQ_DIM = 1

# torch 2.13 renamed the *_tensor collectives to *_single; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_tp_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the tp group of the mesh made by ``init_mesh``."""
    return group if group is not None else get_mesh().tp_group


def _chunk_size(x: Tensor, dim: int, world: int, what: str) -> int:
    n = x.shape[dim]
    if n % world:
        raise ValueError(f"{what}: dim {dim} of shape {tuple(x.shape)} has size {n}, "
                         f"which the tensor-parallel size {world} does not divide")
    return n // world


def all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum of ``x`` over the group, out of place."""
    if dist.get_world_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def split(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's chunk of ``x`` along ``dim``."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    n = _chunk_size(x, dim, world, "split")
    return x.narrow(dim, dist.get_rank(group) * n, n).contiguous()


def all_gather(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """The chunks of every rank concatenated along ``dim`` in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    _all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's chunk along ``dim`` of the sum of ``x`` over the group."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    n = _chunk_size(x, dim, world, "reduce_scatter")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n, *front.shape[1:]))
    _reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


def _identity(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    return x.view_as(x)


def _sum(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    return all_reduce(x, group)


class _Conjugate(torch.autograd.Function):
    """Forward ``fwd(x, dim, group)``, backward its conjugate ``bwd(grad, dim, group)``."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, dim: int, fwd, bwd) -> Tensor:
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return fwd(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.bwd(grad, ctx.dim, ctx.group), None, None, None, None


def copy_to_tp_region(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """f: identity forward, all-reduce backward. Enters a region where each rank computes a shard."""
    return _Conjugate.apply(x, resolve_tp_group(group), -1, _identity, _sum)


def reduce_from_tp_region(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """g: all-reduce forward, identity backward. Sums the partial results of a tp region."""
    return _Conjugate.apply(x, resolve_tp_group(group), -1, _sum, _identity)


def scatter_to_tp_region(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """[..., h] -> [..., h/tp]: keep this rank's slice of the last dim; all-gather backward."""
    return _Conjugate.apply(x, resolve_tp_group(group), x.dim() - 1, split, all_gather)


def gather_from_tp_region(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """[..., h/tp] -> [..., h]: all-gather the last dim; split backward."""
    return _Conjugate.apply(x, resolve_tp_group(group), x.dim() - 1, all_gather, split)


def scatter_to_sequence_parallel_region(x: Tensor, group: dist.ProcessGroup | None = None,
                                        dim: int = SEQ_DIM) -> Tensor:
    """[b, s, h] -> [b, s/tp, h]: keep this rank's slice of the sequence; all-gather backward."""
    return _Conjugate.apply(x, resolve_tp_group(group), dim, split, all_gather)


def gather_from_sequence_parallel_region(x: Tensor, group: dist.ProcessGroup | None = None, dim: int = SEQ_DIM,
                                         tensor_parallel_output_grad: bool = True) -> Tensor:
    """[b, s/tp, h] -> [b, s, h]: all-gather the sequence.

    Backward: reduce-scatter when the gathered tensor feeds tensor-parallel compute (each rank's
    gradient is a partial sum, e.g. the input of a ColumnParallelLinear); a plain split when every
    rank computes the same full gradient (``tensor_parallel_output_grad=False``).
    """
    backward = reduce_scatter if tensor_parallel_output_grad else split
    return _Conjugate.apply(x, resolve_tp_group(group), dim, all_gather, backward)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group: dist.ProcessGroup | None = None,
                                               dim: int = SEQ_DIM) -> Tensor:
    """[b, s, h] partial sums -> [b, s/tp, h] summed: reduce-scatter the sequence; all-gather backward."""
    return _Conjugate.apply(x, resolve_tp_group(group), dim, reduce_scatter, all_gather)
