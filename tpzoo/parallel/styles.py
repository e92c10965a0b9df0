"""The styles of a ``ShardingPlan`` (``tpzoo.sharding_plan``): how each turns a plain module into its
tensor-parallel form on this rank, and what it says of the parameters (``param_facts``).

Every style takes the module at a path and a ``Site`` (the plan, the path, the module's parent and
whether the path lies in the sequence-parallel region) and returns what goes in its place. Weights
are never drawn here: the plain module's full weight is split, so a model has the same full weights
at every tp. Linear layers follow Megatron-LM (Shoeybi et al. 2019, sec. 3):

    column        Y = X A + b,  A = [A_1 ... A_p]: rank r keeps rows r out/tp ... of A [out, in] and b;
                  X arrives whole (or, in the sequence region, as [b, s/tp, in]: all-gathered)
    grouped_qkv   column, after checking that tp divides the attention's heads and query groups
    experts       every expert MLP of a mixture of experts split as column and row, one all-reduce for all; at
                  ep > 1 each rank keeps N/ep experts, the tokens sent to them (``tpzoo.parallel.experts``)
    row           Y = sum_r X_r A_r + b, A = [A_1; ...; A_p]: rank r keeps columns r in/tp ...; the sum is
                  all-reduced (in the sequence region reduce-scattered to [b, s/tp, out]), b added once
    vocab         rows of the vocabulary padded to V' (a multiple of vocab_multiple x tp): rank r keeps
                  rows r V'/tp ...; an nn.Embedding looks its ids up in its slice and the ranks sum (in
                  the sequence region reduce-scatter) the result
    vocab_output  ``VocabParallelOutput``: logits against that slice, vocab-parallel cross entropy

The others keep the module whole and only state facts or place a hook or wrapper: ``norm``
(gradient partial in the sequence region), ``heads`` (``TPRandom``, partial gradients, and under
selective recompute ``Recomputed``), ``partial``, ``replicated``, ``scatter`` (a forward hook cutting
the output to this rank's sequence slice in the sequence region), ``gather`` (a forward pre-hook
gathering the first input along the sequence under sequence parallelism; the backward splits it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from tpzoo.parallel.collectives import (copy_to_tp_region, gather_from_sequence_parallel_region, reduce_from_tp_region,
                                        reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region)
from tpzoo.parallel.experts import expert_parallel
from tpzoo.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelOutput,
                                   padded_vocab_size)
from tpzoo.parallel.param_facts import mark
from tpzoo.parallel.plan import ParallelPlan
from tpzoo.parallel.random import TPRandom
from tpzoo.parallel.recompute import Recomputed


@dataclass(frozen=True)
class Site:
    """Where a style applies: the path of the module, its parent (None at the root), the plan, whether
    the path lies in the sequence-parallel region (sequence parallelism on, no ``gather`` above), and the
    multiple the vocabulary is padded to (times tp)."""

    path: str
    parent: nn.Module | None
    plan: ParallelPlan
    sequence: bool
    vocab_multiple: int

    @property
    def tp(self) -> int:
        return self.plan.tp_size


def _linear(module: nn.Module, site: Site, style: str) -> nn.Linear:
    if type(module) is not nn.Linear:
        raise TypeError(f"{site.path}: the sharding plan styles it {style!r}, which takes an nn.Linear, "
                        f"got {type(module).__name__}")
    return module


def _copy(full: Tensor) -> Callable[[Tensor], object]:
    """An init method that fills the full weight with ``full`` (the plain module's)."""
    return lambda w: w.copy_(full.detach())


@torch.no_grad()
def _load_bias(target: nn.Parameter | None, full: Tensor | None, dim_split: bool, site: Site) -> None:
    if target is not None:
        target.copy_(full.chunk(site.tp)[site.plan.mesh.tp_rank] if dim_split else full)


def _split(module: nn.Module, site: Site, style: str, dim: int) -> nn.Module:
    """The plain linear as ``ColumnParallelLinear`` (``dim`` 0: rows of its weight split, and its bias) or
    ``RowParallelLinear`` (``dim`` 1: columns split, the bias kept whole)."""
    linear = _linear(module, site, style)
    size, name = (linear.out_features, "out_features") if dim == 0 else (linear.in_features, "in_features")
    if size % site.tp:
        raise ValueError(f"{site.path}: {name}={size} is not divisible by the tensor-parallel size tp={site.tp}; "
                         f"choose a size that tp divides, or another tp")
    cls = ColumnParallelLinear if dim == 0 else RowParallelLinear
    layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, init_method=_copy(linear.weight),
                sequence_parallel=site.sequence, tp_group=site.plan.mesh.tp_group, dtype=linear.weight.dtype)
    _load_bias(layer.bias, linear.bias, dim == 0, site)
    return layer


def column(module: nn.Module, site: Site) -> nn.Module:
    return _split(module, site, "column", 0)


def row(module: nn.Module, site: Site) -> nn.Module:
    return _split(module, site, "row", 1)


def grouped_qkv(module: nn.Module, site: Site) -> nn.Module:
    attention = site.parent
    for size in ("num_attention_heads", "num_query_groups"):
        n = getattr(attention, size, None)
        if n is None:
            raise TypeError(f"{site.path}: 'grouped_qkv' needs a parent attention with {size} (tpzoo.models.Attention)")
        if n % site.tp:
            raise ValueError(f"{size}={n} is not divisible by the tensor-parallel size tp={site.tp}: each tp rank "
                             f"holds whole query groups and their key/value heads; choose tp dividing {n}")
    return column(module, site)


def experts(module: nn.Module, site: Site) -> nn.Module:
    """The stacked expert MLPs of a ``tpzoo.models.moe.Experts`` split as ``column`` and ``row`` split an MLP, each
    expert's rows of ``dense_h_to_4h`` [N, f, h] (dim 1) and columns of ``dense_4h_to_h`` [N, h, f] (dim 2), without
    collectives of their own, one of each for the layer: the routed tokens [T, h] and their routing weights and
    experts [T, k] enter through f (identity; backward all-reduce), the weighted sum of all experts leaves through g
    (all-reduce; backward identity). f on the weights makes their gradient whole on every rank (each rank's is a
    partial sum), as the router needs. In the sequence region the tokens are this rank's [T/tp]: they enter
    all-gathered (backward reduce-scatter) and the sum leaves reduce-scattered to them; the parent mixture of
    experts' ``sequence_sum`` then all-reduces over tp (its router's losses are per whole sequence)."""
    mesh = site.plan.mesh
    for name, dim in (("dense_h_to_4h", 1), ("dense_4h_to_h", 2)):
        weight = getattr(module, name, None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 3:
            raise TypeError(f"{site.path}: 'experts' takes stacked expert weights {name} [N, out, in] "
                            f"(tpzoo.models.moe.Experts), got {type(module).__name__}")
        if weight.shape[dim] % site.tp:
            raise ValueError(f"{site.path}.{name}: {weight.shape[dim]} features per expert is not divisible by the "
                             f"tensor-parallel size tp={site.tp}; choose a size that tp divides, or another tp")
        shard = weight.detach().chunk(site.tp, dim)[mesh.tp_rank].clone()
        setattr(module, name, mark(nn.Parameter(shard), tp_split_dim=dim))
    if mesh.ep_size > 1:  # then this rank's N/ep experts, the tokens sent to them by all-to-all over ep
        expert_parallel(module, mesh.ep_group)
    if site.tp == 1:
        return module
    group = mesh.tp_group
    if site.sequence:
        if hasattr(site.parent, "sequence_sum"):  # the router's per-sequence losses add the other ranks' tokens
            site.parent.sequence_sum = lambda t: reduce_from_tp_region(t, group)

        def enter(m: nn.Module, args: tuple) -> tuple:
            x, weights, indices = (gather_from_sequence_parallel_region(t, group, 0, t.is_floating_point())
                                   for t in args[:3])
            return (x, weights, indices, *args[3:])

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(lambda m, args, out: reduce_scatter_to_sequence_parallel_region(out, group, 0))
    else:
        module.register_forward_pre_hook(lambda m, args: (copy_to_tp_region(args[0], group),
                                                          copy_to_tp_region(args[1], group), *args[2:]))
        module.register_forward_hook(lambda m, args, out: reduce_from_tp_region(out, group))
    return module


def vocab(module: nn.Module, site: Site) -> nn.Module:
    mesh = site.plan.mesh
    if isinstance(module, nn.Embedding):
        options = {"padding_idx": module.padding_idx, "max_norm": module.max_norm,
                   "scale_grad_by_freq": module.scale_grad_by_freq or None, "sparse": module.sparse or None}
        given = ", ".join(f"{k}={v}" for k, v in options.items() if v is not None)
        if given:
            raise TypeError(f"{site.path}: 'vocab' splits a plain nn.Embedding lookup, but this one has {given}, "
                            f"which its vocab-parallel form does not honour; drop the option (mask padding in "
                            f"the loss)")
    if isinstance(module, (nn.Embedding, nn.Linear)) and getattr(module, "bias", None) is None:
        rows, h = module.weight.shape
        return VocabParallelEmbedding(rows, h, _copy(module.weight), pad_vocab_to_multiple_of=site.vocab_multiple,
                                      sequence_parallel=site.sequence, tp_group=mesh.tp_group,
                                      dtype=module.weight.dtype)
    params = dict(module.named_parameters(recurse=False))
    if not params or any(p.dim() != 1 for p in params.values()) or list(module.children()):
        raise TypeError(f"{site.path}: 'vocab' takes an nn.Embedding, an nn.Linear without bias or a module of "
                        f"[V] vectors, got {type(module).__name__}")
    for name, p in params.items():  # [V] -> this rank's [V'/tp], zero on the padding
        size = padded_vocab_size(p.shape[0], site.tp, site.vocab_multiple) // site.tp
        padded = torch.cat([p.detach(), p.new_zeros(size * site.tp - p.shape[0])])
        shard = nn.Parameter(padded[mesh.tp_rank * size:(mesh.tp_rank + 1) * size].clone())
        setattr(module, name, mark(shard, tp_split_dim=0, tp_full_size=p.shape[0]))
    return module


def vocab_output(module: nn.Module, site: Site) -> nn.Module:
    if list(module.parameters()) or not hasattr(module, "vocab_size"):
        raise TypeError(f"{site.path}: 'vocab_output' takes a module without parameters that computes logits and "
                        f"loss over vocab_size tokens (tpzoo.models.LMOutput), got {type(module).__name__}")
    return VocabParallelOutput(module.vocab_size, site.sequence, site.plan.mesh.tp_group, site.plan.kernels)


def _mark_all(module: nn.Module, **facts: Any) -> nn.Module:
    for p in module.parameters():
        mark(p, **facts)
    return module


def norm(module: nn.Module, site: Site) -> nn.Module:
    return _mark_all(module, tp_partial=site.sequence)


def heads(module: nn.Module, site: Site) -> nn.Module:
    _mark_all(module, tp_partial=True)
    if list(module.parameters()):
        return module  # its random draws (if any) are its own to place; wrapping would rename its parameters
    rng = site.plan.mesh.rng
    module = TPRandom(module, rng)
    return Recomputed(module, rng) if site.plan.recompute_granularity == "selective" else module


def partial(module: nn.Module, site: Site) -> nn.Module:
    return _mark_all(module, tp_partial=True)


def replicated(module: nn.Module, site: Site) -> nn.Module:
    return _mark_all(module, tp_partial=False)


def scatter(module: nn.Module, site: Site) -> nn.Module:
    _mark_all(module, tp_partial=False)  # the scatter's backward gathers: every rank holds the whole gradient
    if site.sequence:
        group = site.plan.mesh.tp_group
        module.register_forward_hook(lambda m, args, out: scatter_to_sequence_parallel_region(out, group))
    return module


def gather(module: nn.Module, site: Site) -> nn.Module:
    if site.plan.sequence_parallel:
        group = site.plan.mesh.tp_group

        def hook(m: nn.Module, args: tuple) -> tuple:
            first = gather_from_sequence_parallel_region(args[0], group, tensor_parallel_output_grad=False)
            return (first, *args[1:])

        module.register_forward_pre_hook(hook)
    return module


STYLE_FUNCTIONS: dict[str, Callable[[nn.Module, Site], nn.Module]] = {
    "column": column, "grouped_qkv": grouped_qkv, "row": row, "experts": experts, "vocab": vocab,
    "vocab_output": vocab_output,
    "norm": norm, "heads": heads, "partial": partial, "replicated": replicated, "scatter": scatter, "gather": gather,
}
