"""Full (unsharded) state dicts: the same tensors whatever tp built the model.

A tensor-parallel model holds shards; the *full* state dict holds what tp=1 would hold, with the
vocabulary cut back to its real size V (no padding rows), so it does not depend on tp:

    parameter of                 shard on rank r               full
    ColumnParallelLinear weight  rows r out/tp ... [out/tp, in]  [out, in]   (bias likewise [out])
    RowParallelLinear weight     cols r in/tp ...  [out, in/tp]  [out, in]   (bias replicated)
    VocabParallelEmbedding       rows r V'/tp ...  [V'/tp, h]    [V, h]
    VocabParallelBias            r V'/tp ...       [V'/tp]       [V]
    anything else                replicated                      as is

A mixture of experts' expert weights under expert parallelism (``param_facts``: ``ep_split``) hold this ep rank's
N/ep experts of the N: the full tensor is the ep group's concatenated along dim 0 (after the tp gather).

``full_state_dict`` gathers (every tp rank must call it, and gets the result; under FSDP, where each
value is a DTensor sharded over dp, every dp rank too: the dp pieces are gathered first; under ep every ep rank);
``load_full_state_dict`` keeps this rank's slice (no communication; under FSDP its dp rows of it).
Checkpoints and the Hugging Face converter go through these two.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpzoo.parallel import ParallelMesh, get_mesh
from tpzoo.parallel.collectives import all_gather
from tpzoo.parallel.param_facts import facts

# A last pipeline stage's copy of the tied word embedding (``embedding.add_output_weight``): saved
# state holds only the first stage's weight, and the copy is loaded from it.
TIED_COPY, TIED_SOURCE = "head.word_embeddings.weight", "embedding.word_embeddings.weight"


def model_mesh(model: nn.Module) -> ParallelMesh:
    """The mesh ``model`` was built for (``build_model`` keeps it), or for a plain model ``get_mesh()``."""
    return getattr(model, "mesh", None) or get_mesh()


def source_name(name: str) -> str:
    """The name under which saved state holds parameter ``name`` (the tied copy reads the embedding's)."""
    return TIED_SOURCE if name == TIED_COPY else name


def tp_partitions(model: nn.Module, tp: int) -> dict[str, tuple[int, int]]:
    """name -> (partition dim, full size along it) for every tp shard (``param_facts``: ``tp_split_dim``).

    The full size is tp x the shard, less the vocabulary padding (``tp_full_size``, the real vocabulary).
    """
    out: dict[str, tuple[int, int]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        f = facts(p)
        if f.tp_split_dim is not None:
            out[name] = (f.tp_split_dim, f.tp_full_size or p.shape[f.tp_split_dim] * tp)
    return out


def expert_names(model: nn.Module) -> set[str]:
    """The names of the expert weights split over ep (``param_facts``: ``ep_split``)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if facts(p).ep_split}


def gather_full(tensors: dict[str, Tensor], partitions: dict[str, tuple[int, int]], mesh: ParallelMesh,
                experts: set[str] = frozenset()) -> dict[str, Tensor]:
    """Shards -> full tensors (collective over tp, and ep for ``experts``, in ``tensors``' order; every rank of
    them gets them). A DTensor (FSDP: the tp shard sharded over dp) is gathered over its mesh first
    (``full_tensor``)."""
    out = {}
    for name, t in tensors.items():
        if isinstance(t, DTensor):
            t = t.detach().full_tensor()
        if name in partitions:
            dim, size = partitions[name]
            t = all_gather(t.detach(), dim, mesh.tp_group).narrow(dim, 0, size)
        if name in experts and mesh.ep_size > 1:
            t = all_gather(t.detach(), 0, mesh.ep_group)
        out[name] = t.detach().clone()
    return out


def full_state_dict(model: nn.Module, mesh: ParallelMesh | None = None) -> dict[str, Tensor]:
    """The model's state dict with every shard gathered and padding dropped (see module docstring)."""
    mesh = mesh or model_mesh(model)
    return gather_full(model.state_dict(), tp_partitions(model, mesh.tp_size), mesh, expert_names(model))


def full_grads(model: nn.Module, mesh: ParallelMesh | None = None) -> dict[str, Tensor]:
    """Each parameter's gradient gathered like ``full_state_dict`` (parameters without one are left out)."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    mesh = mesh or model_mesh(model)
    return gather_full(grads, tp_partitions(model, mesh.tp_size), mesh, expert_names(model))


def shard(full: Tensor, dim: int, local_size: int, mesh: ParallelMesh) -> Tensor:
    """This tp rank's ``local_size`` slice along ``dim`` of ``full``, zero-padded to tp x local_size."""
    padded = local_size * mesh.tp_size
    if full.shape[dim] > padded:
        raise ValueError(f"a tensor of size {full.shape[dim]} along dim {dim} does not fit {mesh.tp_size} "
                         f"shards of {local_size}")
    if full.shape[dim] < padded:
        pad = list(full.shape)
        pad[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad)], dim)
    return full.narrow(dim, mesh.tp_rank * local_size, local_size)


def dp_rows(n: int, mesh: ParallelMesh, over: DeviceMesh | None = None) -> tuple[int, int]:
    """[start, stop) of this dp rank's rows of ``n`` split as FSDP splits dim 0 (chunks of ceil(n / dp),
    the last ones short or empty); ``over``: the mesh FSDP sharded over, its last dimension (default
    ``mesh.fsdp_mesh``: dp x cp, HSDP's shard dimension; an expert weight's: edp)."""
    over = mesh.fsdp_mesh if over is None else over
    size, rank = over.size(over.ndim - 1), over.get_local_rank(over.ndim - 1)
    chunk = -(-n // size)
    return min(rank * chunk, n), min((rank + 1) * chunk, n)


def full_shape(local: Sequence[int], partition: tuple[int, int] | None, ep: int = 1) -> tuple[int, ...]:
    """The full (unpadded) shape of a tensor shaped like a parameter whose shard has shape ``local`` (``ep``: an
    expert weight's ep size, which dim 0 is split over)."""
    shape = list(local)
    if partition is not None:
        shape[partition[0]] = partition[1]
    shape[0] *= ep
    return tuple(shape)


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, Tensor], mesh: ParallelMesh | None = None, *,
                         strict: bool = True) -> list[str]:
    """Copy a full state dict (any tp wrote it) into this rank's shards.

    ``strict``: the keys must match exactly and the shapes fit. Otherwise the parameters that ``state``
    lacks or holds in another full shape keep their values, and their names are returned (sorted).
    """
    mesh = mesh or model_mesh(model)
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not fit {type(model).__name__}: missing {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                       f"{' ...' if len(unexpected) > 8 else ''}")
    partitions, experts = tp_partitions(model, mesh.tp_size), expert_names(model)
    kept = list(missing)
    for name, target in own.items():
        if name not in state:
            continue
        value, partition = state[name], partitions.get(name)
        ep = mesh.ep_size if name in experts else 1
        if not strict and tuple(value.shape) != full_shape(target.shape, partition, ep):
            kept.append(name)
            continue
        if ep > 1:  # this ep rank's experts
            if value.shape[0] != target.shape[0] * ep:
                raise ValueError(f"{name}: {target.shape[0] * ep} experts expected, got shape {tuple(value.shape)}")
            value = value.narrow(0, mesh.ep_rank * target.shape[0], target.shape[0])
        if partition is not None:
            dim, size = partition
            if value.shape[dim] != size:
                raise ValueError(f"{name}: full size {size} along dim {dim} expected, got shape {tuple(value.shape)}")
            value = shard(value, dim, target.shape[dim], mesh)
        if isinstance(target, DTensor):  # FSDP: this rank's rows of its tp shard, over dp (edp: an expert weight)
            start, stop = dp_rows(value.shape[0], mesh, target.device_mesh)
            target, value = target.to_local(), value[start:stop]
        if value.shape != target.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} does not match the model's {tuple(target.shape)}")
        target.copy_(value)
    return sorted(kept)
