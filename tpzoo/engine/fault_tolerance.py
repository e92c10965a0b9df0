"""Per-step fault tolerance across replica groups (``--fault-tolerance``; docs/elastic.md) on torchft's ``Manager``:
a group that fails drops out of the next step while the others go on; one that comes back copies a live group's
state and joins, all without restarting the groups that stayed.

A run is N replica groups, each a mesh of its own (its own launch of pp x dp x tp x cp ranks) holding the whole
model; rank r of every group holds the same shards. Every step:

    begin()        torchft's quorum: which groups are live this step (its lighthouse decides); a group behind the
                   others (restarted) first receives a live group's state (the caller's state functions, registered
                   with the manager: weights, optimizer, data position), before it reads its batch
    slot()         group i's dp rank d takes the rows of slot i dp + d of the N dp slots of the global batch G: with
                   every group live the step is plain data parallelism over N x dp
    all_reduce()   after the sums inside the group, the gradients (and the loss) summed over the live groups, times
                   N / live: exactly plain dp's sums when every group is live; when some are not, the live groups'
                   rows weighed as if each group's held the same number of labels (GPT's do; BERT's masks, about)
    commit()       whether this group's ranks all finished the step's all-reduces (torchft's ``should_commit``,
                   agreed inside the group) with at least the minimum of groups live; if not, this group does not
                   update and takes the step again (a group that committed goes on; one left behind heals at the
                   next quorum)

Rank r of group i all-reduces with rank r of the other groups only (torchft's reconfigurable process group), so any
tp, pp, cp and FSDP layout inside a group works unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from tpzoo.parallel.fsdp import local


class ReplicaGroups:
    """Replica group ``index`` of ``count`` under torchft's ``manager`` (a ``torchft.Manager`` of this rank, made
    with a synchronous quorum: a group heals before its step, not during it)."""

    def __init__(self, manager: Any, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise ValueError(f"replica group {index} of {count}: the index must lie in [0, {count})")
        self.manager, self.index, self.count = manager, index, count

    def begin(self) -> None:
        """Before a step's batch is read: the quorum, and healing if this group is behind (collective over the
        group's ranks through torchft's manager). RuntimeError when more groups are live than ``count``."""
        self.manager.start_quorum()
        if self.live > self.count:
            raise RuntimeError(f"{self.live} replica groups are live but --ft-replica-groups is {self.count}: launch "
                               f"every group with the same --ft-replica-groups and its own --ft-replica-id")

    @property
    def live(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    def slot(self, dp_size: int, dp_rank: int) -> tuple[int, int]:
        """(this rank's slot, the slots): the rows of the global batch it takes are slot x G / slots on."""
        return self.index * dp_size + dp_rank, self.count * dp_size

    @torch.no_grad()
    def all_reduce(self, tensors: list[Tensor]) -> None:
        """Sum ``tensors`` (float32, this rank's parts) over the live groups in one all-reduce, times count / live,
        in place. A failure of a peer leaves them unusable: ``commit`` then says no."""
        parts = [local(t) for t in tensors]
        flat = torch._utils._flatten_dense_tensors(parts)
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        flat *= self.count / max(self.live, 1)
        for part, summed in zip(parts, torch._utils._unflatten_dense_tensors(flat, parts)):
            part.copy_(summed)

    def close(self) -> None:
        """Stop torchft's manager (its server on rank 0, its threads), not waiting for them."""
        self.manager.shutdown(wait=False)

    def commit(self) -> bool:
        """Whether this group may update after the step (module docstring; collective over the group)."""
        return bool(self.manager.should_commit())
