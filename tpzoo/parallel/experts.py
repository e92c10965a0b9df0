"""Expert parallelism (GShard, Lepikhin et al. 2020; Megatron-LM's ``--expert-model-parallel-size``): the N experts
of a mixture of experts (``tpzoo.models.moe.Experts``) split over the ep ranks of a group, rank r holding experts
r N/ep ... (r + 1) N/ep - 1, and every routed token sent to its expert's rank and its output back, by all-to-all.

    expert_parallel(moe.experts, ep_group)      # in place: the weights cut to this rank's experts, the dispatch set

A forward (``AllToAllDispatch``), with the routed rows of this rank sorted expert by expert:

    counts      all-to-all of the rows per expert [N]: each rank learns how many rows each source sends each of
                its experts ([ep, N/ep]); read on the host (the one sync: the next all-to-all needs the splits)
    dispatch    all-to-all of the rows, source by source, regrouped expert by expert; the experts run on them
    combine     the outputs regrouped source by source, all-to-all back: each row's output at its source

The all-to-alls are differentiable (their backward is the reverse all-to-all), so an expert's gradient sums over the
rows of every rank of the group that reached it, and each source's input gradient comes back to it. An expert's
weights are held by one rank of each ep group: their gradients are to be reduced over the ranks that hold the same
experts (the expert-data-parallel group), the router's over every data-parallel rank.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from tpzoo.parallel.param_facts import facts, mark


def _expert_major(matrix: Tensor) -> Tensor:
    """The permutation taking rows laid out source by source, expert by expert within each (``matrix`` [ep, E]
    rows per (source, expert)), to expert by expert, source by source within each."""
    sizes = matrix.flatten()
    starts = sizes.cumsum(0) - sizes
    segments = torch.arange(sizes.numel(), device=sizes.device).view(matrix.shape).t().flatten()
    new_sizes = sizes[segments]
    segment_of_row = torch.repeat_interleave(torch.arange(segments.numel(), device=sizes.device), new_sizes)
    new_starts = new_sizes.cumsum(0) - new_sizes
    position = torch.arange(int(new_sizes.sum()), device=sizes.device)
    return starts[segments][segment_of_row] + position - new_starts[segment_of_row]


class AllToAllDispatch:
    """``tpzoo.models.moe.Experts``' dispatch over an ep ``group`` (module docstring)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.ep = group, dist.get_world_size(group)

    def __call__(self, rows: Tensor, counts: Tensor, run: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)      # [ep sources x N/ep local experts]
        matrix, sent = received.view(self.ep, -1), counts.view(self.ep, -1).sum(1)
        send, recv = sent.tolist(), matrix.sum(1).tolist()  # the host sync: the all-to-all's splits
        arrived = wait_tensor(all_to_all_single_autograd(rows, recv, send, self.group))
        order = _expert_major(matrix)
        out = run(arrived[order], matrix.sum(0))[order.argsort()]          # back to source by source
        return wait_tensor(all_to_all_single_autograd(out, send, recv, self.group))


def expert_parallel(experts: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """``experts`` (a ``tpzoo.models.moe.Experts`` holding all N experts) cut to this rank's N/ep of the ep ``group``
    (its weights keep their facts and are marked ``ep_split``) and given ``AllToAllDispatch``; in place, returned.
    ValueError when ep does not divide N."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    n = experts.num_experts
    if n % ep:
        raise ValueError(f"expert parallelism: ep={ep} does not divide the {n} experts; choose an ep dividing {n}")
    held = slice(rank * n // ep, (rank + 1) * n // ep)
    for name in ("dense_h_to_4h", "dense_4h_to_h"):
        weight = getattr(experts, name)
        cut = nn.Parameter(weight.detach()[held].clone(), requires_grad=weight.requires_grad)
        setattr(experts, name, mark(cut, **{**vars(facts(weight)), "ep_split": True}))
    experts.dispatch = AllToAllDispatch(group)
    return experts
