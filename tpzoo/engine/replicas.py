"""The first step's check that every replicated parameter's gradient is what its facts say.

A parameter replicated over tp (``param_facts``: no ``tp_split_dim``) ends backward with one of two
kinds of gradient: the whole gradient, the same on every tp rank (it met activations every rank holds
in full), or a partial sum (it met activations split over tp: sequence shards, heads, features), which
the engine sums over tp (``tp_partial``, ``sync_sequence_parallel_grads``). ``tpzoo.parallel.parallelize``
sets the fact from the sharding plan and the sequence-parallel region; a model author's parameter used
somewhere the plan does not describe would train silently wrong. So on the first step, before the sum
and before any weight changes, each replicated gradient is compared across the tp ranks (one
all-reduce of [g, -g] with MAX):

    not tp_partial, but the ranks' gradients differ      it met split activations: its gradient must be
                                                         summed ("partial" in the plan)
    tp_partial, but every rank holds the very same       it met replicated activations: summing would
    nonzero gradient                                     multiply it by tp ("replicated" in the plan)

Either raises ``PlanError`` naming the parameters and the plan entry that fixes them. Gradients
computed alike on every rank are bitwise equal; ``RTOL`` allows what nondeterministic GPU kernels add.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tpzoo.parallel.fsdp import local
from tpzoo.parallel.mesh import ParallelMesh
from tpzoo.parallel.param_facts import facts

RTOL = 1e-4  # a replicated gradient may differ across tp by this much of its largest entry (float32; the engine
             # allows 8 ulps of a lower precision's largest entry, what nondeterministic kernels may add)


class PlanError(ValueError):
    """A model's sharding plan does not describe how a parameter is used (see module docstring)."""


def _spread(grads: list[Tensor], mesh: ParallelMesh) -> list[tuple[float, float]]:
    """Per gradient: (its largest entry's max - min over tp, its largest |entry| on any tp rank)."""
    flat = torch.cat([g.detach().reshape(-1).float() for g in grads])
    both = torch.cat([flat, -flat])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=mesh.tp_group)
    high, low = both[:flat.numel()], -both[flat.numel():]
    sizes = [g.numel() for g in grads]
    spread = torch.stack([part.max() for part in (high - low).split(sizes)])
    size = torch.stack([part.max() for part in torch.maximum(high.abs(), low.abs()).split(sizes)])
    return list(zip(spread.tolist(), size.tolist()))


def check_replicas(named: list[tuple[str, nn.Parameter]], mesh: ParallelMesh, rtol: float = RTOL) -> bool:
    """``PlanError`` on every rank unless every replicated parameter of ``named`` (name, parameter holding the
    gradient, before the tp sum) has the gradient its facts say (module docstring; ``rtol``: the spread allowed,
    a share of the gradient's largest entry). Collective over the whole mesh (each tp group checks its own
    parameters; every rank then raises the first problem found on any, so no pipeline stage goes on alone);
    nothing to do at tp 1. Returns whether the check was made: not when a gradient is not finite (a step the
    engine skips), which leaves it to the next step."""
    if mesh.tp_size == 1:
        return True
    # a dp shard of FSDP may be empty on this rank (and on its tp peers alike: they shard the same shapes)
    named = [(n, p) for n, p in named if facts(p).tp_split_dim is None and p.grad is not None and local(p.grad).numel()]
    mine = _problem(named, mesh, rtol) if named else ("", True)
    found: list[tuple[str, bool]] = [("", True)] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    problem = next((p for p, _ in found if p), "")
    if problem:
        raise PlanError(problem)
    return all(finite for _, finite in found)


def _problem(named: list[tuple[str, nn.Parameter]], mesh: ParallelMesh, rtol: float) -> tuple[str, bool]:
    """(What is wrong with this tp group's replicated gradients (module docstring), or ""; whether they are finite)."""
    spreads = _spread([local(p.grad) for _, p in named], mesh)
    if not all(math.isfinite(spread) and math.isfinite(size) for spread, size in spreads):
        return "", False
    unsummed = [n for (n, p), (spread, size) in zip(named, spreads) if not facts(p).tp_partial and spread > rtol * size]
    oversummed = [n for (n, p), (spread, size) in zip(named, spreads) if facts(p).tp_partial and size and not spread]
    tp = mesh.tp_size
    if unsummed:
        return (f"{_shown(unsummed)}: replicated, but the gradient differs across the {tp} tensor-parallel ranks (it "
                f"meets activations split over tp) and the sharding plan keeps it whole; give it the style \"partial\" "
                f"in the model's sharding plan (e.g. '{_pattern(unsummed[0])}': 'partial'), or the style of the layer "
                f"it belongs to"), True
    if oversummed:
        return (f"{_shown(oversummed)}: the sharding plan sums its gradient over the {tp} tensor-parallel ranks, but "
                f"every rank holds the same gradient (it meets activations every rank holds whole); give it the style "
                f"\"replicated\" (e.g. '{_pattern(oversummed[0])}': 'replicated')"), True
    return "", True


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _pattern(name: str) -> str:
    """A plan pattern for parameter ``name``: layer numbers made ``*``."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))
