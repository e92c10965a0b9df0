"""How one rank's tensors go into a DCP checkpoint so that any mesh can read them back.

Every tensor shaped like a parameter (the weight itself, AdamW's exp_avg / exp_avg_sq) is stored by
the parameter's global name, which does not depend on tp or pp (``StagedModel``), as its *full*
tensor, in one of three ways:

    parameter                              stored as                          at load
    tp shard, full size = tp x local       DTensor Shard(dim) on the tp mesh  DCP reads just this rank's rows
      (column/row-parallel weights, the    (each tp rank writes its chunk)
       per-head fused QKV, column biases)
    tp shard of the padded vocabulary      full unpadded tensor, gathered     full tensor read, rank's slice
      (VocabParallelEmbedding weights,       over tp (replicated: DCP writes    kept (``sharding.shard``)
       vocab-parallel output bias)           it once)
    replicated (LayerNorms, row biases)    plain tensor (written once)        read in place

The vocabulary cannot be a DTensor: it is padded to a multiple of m x tp (m: the config's
make_vocab_size_divisible_by, Megatron-LM's flag; 128 unless set), so rank r's shard holds
rows r V'/tp ... of a padded tensor whose size depends on tp, not a ``torch.chunk`` piece of the
unpadded [V, h] one; storing it padded would tie the checkpoint to the tp that wrote it.
Identical items on several ranks (dp replicas, tp peers of a replicated tensor) are written once:
DCP's save planner deduplicates them.

Under FSDP a rank holds only the dp piece of its tp tensor: the parameter (and its optimizer state) is
a DTensor Shard(0) over the dp mesh whose global shape is the tp shard's, rank d holding rows
[d c, min((d+1) c, n)), c = ceil(n / dp). Such an entry (``dp_shape`` set) is stored as the same full
tensor under the same key, so an FSDP checkpoint and a plain one are interchangeable:

    tp shard or replicated               DTensor [Shard(dim) or Replicate(), Shard(0)] on the (tp, dp)
                                           mesh: the tp chunk, then its dp chunk (uneven sizes given)
    tp shard of the padded vocabulary    dp pieces gathered (``full_tensor``), then as above; at load
                                           this rank's dp rows of its tp slice are kept

Under expert parallelism an expert weight (``param_facts``: ``ep_split``; ``ep`` set) holds this ep rank's experts:
a DTensor [Shard(dim) or Replicate(), Shard(0)] on the (tp, ep) mesh, the full tensor holding all N experts, so
any ep (and any tp) reads its slice back. Under FSDP too, its piece is sharded over the edp ranks:
[Shard(dim) or Replicate(), Shard(0), Shard(0)] on the (tp, ep, edp) mesh, this ep rank's experts' edp chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard

from tpzoo.models.base import StagedModel
from tpzoo.models.sharding import (TIED_COPY, dp_rows, expert_names, full_shape, gather_full, shard, source_name,
                                   tp_partitions)
from tpzoo.parallel import ParallelMesh

MODEL_PREFIX = "model."


@dataclass
class Entry:
    """One checkpoint item and this rank's tensor for it.

    ``local`` is what the rank holds (a tp shard for partitioned parameters) and is written into in
    place at load; ``partition`` is (tp dim, full unpadded size) from ``tp_partitions``, None when
    replicated. ``dp_shape``: set when ``local`` is only this rank's Shard(0) piece over dp (FSDP) of
    a tp tensor of that shape (over dp; an expert weight's, ``ep`` > 1, over edp). ``ep``: an expert weight's ep
    size (its experts: dim 0 of ep x as many), else 1.
    """

    key: str
    local: Tensor
    partition: tuple[int, int] | None = None
    dp_shape: tuple[int, ...] | None = None
    ep: int = 1

    def tp_shape(self) -> tuple[int, ...]:
        """The shape of this rank's tp tensor (the whole of it, whatever dp holds)."""
        return self.dp_shape if self.dp_shape is not None else tuple(self.local.shape)

    def padded(self, mesh: ParallelMesh) -> bool:
        """A shard of the padded vocabulary (its full size is not tp x its local size)."""
        return (self.partition is not None
                and self.partition[1] != self.tp_shape()[self.partition[0]] * mesh.tp_size)

    def full_shape(self) -> tuple[int, ...]:
        return full_shape(self.tp_shape(), self.partition, self.ep)

    def sharded(self) -> bool:
        """Stored as a DTensor: a tp shard (not padded), a dp piece or an expert weight split over ep."""
        return bool(self.partition or self.dp_shape or self.ep > 1)

    def dtensor(self, mesh: ParallelMesh) -> DTensor:
        """``local`` as this rank's chunk of a DTensor sharded over the tp mesh, over the (tp, dp)
        mesh for a dp piece, over the (tp, ep) mesh for an expert weight (no copy)."""
        local = self.local.detach()
        if self.ep > 1:
            shape = torch.Size(self.full_shape())
            tp = Shard(self.partition[0]) if self.partition else Replicate()
            on, placements = ((mesh.tp_ep_mesh, [tp, Shard(0)]) if self.dp_shape is None else
                              (mesh.tp_ep_edp_mesh, [tp, Shard(0), Shard(0)]))
            return DTensor.from_local(local, on, placements, run_check=False, shape=shape,
                                      stride=_contiguous_stride(shape))
        if self.dp_shape is None:
            return DTensor.from_local(local, mesh.device_mesh["tp"], [Shard(self.partition[0])], run_check=False)
        shape = torch.Size(self.full_shape())
        tp = Shard(self.partition[0]) if self.partition else Replicate()
        return DTensor.from_local(local, mesh.tp_fsdp_mesh, [tp, *fsdp_placements(mesh)], run_check=False,
                                  shape=shape, stride=_contiguous_stride(shape))

    def tp_tensor(self, mesh: ParallelMesh) -> Tensor:
        """This rank's whole tp tensor: ``local``, or its dp pieces gathered (collective over dp, or edp)."""
        if self.dp_shape is None:
            return self.local
        shape = torch.Size(self.dp_shape)
        over, placements = (mesh.edp_mesh, [Shard(0)]) if self.ep > 1 else (mesh.fsdp_mesh, fsdp_placements(mesh))
        return DTensor.from_local(self.local.detach(), over, placements, run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape)).full_tensor()


def fsdp_placements(mesh: ParallelMesh) -> list[Shard | Replicate]:
    """How FSDP lays a weight's dp piece out on ``mesh.fsdp_mesh``: Shard(0), or under HSDP replicated, then
    Shard(0) over the shard dimension."""
    return [Shard(0)] if mesh.replicas is None else [Replicate(), Shard(0)]


def entry(key: str, tensor: Tensor, partition: tuple[int, int] | None = None, ep: int = 1) -> Entry:
    """An entry for ``tensor``: a plain tp tensor, or a DTensor Shard(0) over dp (FSDP; an expert weight's over edp)
    whose local view becomes ``local`` (loading writes into the DTensor's own storage); ``ep``: an expert weight's ep
    size."""
    if isinstance(tensor, DTensor):
        over = tensor.device_mesh.mesh_dim_names or ("",)
        fsdp = (tuple(tensor.placements), over) in (((Shard(0),), ("dp",)), ((Shard(0),), ("dp_cp",)),
                                                    ((Shard(0),), ("edp",)),
                                                    ((Replicate(), Shard(0)), ("replicate", "shard")))
        if not fsdp:
            raise ValueError(f"{key}: a checkpoint holds DTensors sharded Shard(0) over dp (or edp, or HSDP's shard "
                             f"dimension) only, got {tensor.placements} on {tensor.device_mesh}")
        return Entry(key, tensor.to_local(), partition, tuple(tensor.shape), ep)
    return Entry(key, tensor, partition, ep=ep)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def model_entries(model: StagedModel, mesh: ParallelMesh, *, loading: bool = False,
                  weights: dict[str, Tensor | None] | None = None) -> list[Entry]:
    """Entries for the parameters of a model (or pipeline stage), keyed "model.<global name>".

    Saving leaves out a last stage's copy of the tied word embedding (the first stage's weight is
    saved); loading keys that copy by the embedding's name, so both copies read the same weight.
    ``weights``: name -> the tensor to store (and fill) instead of the state dict's, None to leave the
    name out (an engine's float32 main weights, ``MainParams.weights``: under ZeRO-1 only their owner's).
    """
    partitions, experts = tp_partitions(model, mesh.tp_size), expert_names(model)
    tensors = {**model.state_dict(), **(weights or {})}
    return [entry(MODEL_PREFIX + source_name(name), t, partitions.get(name), mesh.ep_size if name in experts else 1)
            for name, t in tensors.items() if t is not None and (loading or name != TIED_COPY)]


def save_items(entries: list[Entry], mesh: ParallelMesh) -> dict[str, Tensor]:
    """key -> what ``dcp.save`` writes (see the module docstring). Collective over tp (and dp for dp
    pieces): the padded vocabulary tensors are gathered, in ``entries``' order (the same on every rank)."""
    padded = [e for e in entries if e.padded(mesh)]
    full = gather_full({e.key: e.tp_tensor(mesh) for e in padded}, {e.key: e.partition for e in padded}, mesh)
    return {e.key: full[e.key] if e.key in full else e.dtensor(mesh) if e.sharded() else e.local.detach()
            for e in entries}


def load_targets(entries: list[Entry], mesh: ParallelMesh) -> dict[str, Tensor]:
    """key -> what ``dcp.load`` fills: DTensors and replicated tensors over the entries' own storage,
    a new full tensor for each padded one (``finish_load`` copies its slice in)."""
    out: dict[str, Tensor] = {}
    for e in entries:
        if e.padded(mesh):
            out[e.key] = torch.empty(e.full_shape(), dtype=e.local.dtype, device=e.local.device)
        else:
            out[e.key] = e.dtensor(mesh) if e.sharded() else e.local.detach()
    return out


@torch.no_grad()
def finish_load(entries: list[Entry], targets: dict[str, Tensor], mesh: ParallelMesh) -> None:
    """Copy this rank's slice of each loaded full padded-vocabulary tensor into its shard (its dp rows of
    it for a dp piece)."""
    for e in entries:
        if e.padded(mesh):
            dim = e.partition[0]
            piece = shard(targets[e.key], dim, e.tp_shape()[dim], mesh)
            if e.dp_shape is not None:
                start, stop = dp_rows(piece.shape[0], mesh)
                piece = piece[start:stop]
            e.local.copy_(piece)


@torch.no_grad()
def check_finite(entries: list[Entry], folder: Path, mesh: ParallelMesh) -> None:
    """ValueError when a loaded floating-point tensor holds NaN or inf: weights a run diverged into train and
    generate nothing. Collective over the world group (one all-reduce of the count): every rank raises."""
    floats = [e for e in entries if e.local.is_floating_point()]
    # each count onto the mesh's device before the stack: AdamW's ``step`` loads as a host scalar beside CUDA tensors
    counts = torch.stack([(~torch.isfinite(e.local)).sum().to(mesh.device, torch.float64) for e in floats]) \
        if floats else torch.zeros(1, device=mesh.device, dtype=torch.float64)
    per_entry, total = counts.tolist(), counts.sum().reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    if count := int(total.item()):
        first = next((f", {int(n):,} of them in {e.key}" for e, n in zip(floats, per_entry) if n), "")
        raise ValueError(f"checkpoint {folder} holds {count:,} non-finite (NaN or inf) value{'s' * (count > 1)}{first}: "
                         f"the run diverged before it was saved, and it cannot train or generate; load an earlier "
                         f"checkpoint (the line that stopped the run names one)")


def split_by_fit(entries: list[Entry], saved: dict[str, object]) -> tuple[list[Entry], list[Entry]]:
    """(entries the checkpoint holds with the same full shape, the others). ``saved``: the checkpoint's
    ``Metadata.state_dict_metadata``."""
    fits, rest = [], []
    for e in entries:
        meta = saved.get(e.key)
        ok = isinstance(meta, TensorStorageMetadata) and tuple(meta.size) == e.full_shape()
        (fits if ok else rest).append(e)
    return fits, rest
