"""FSDP over the dp axis (ZeRO-3): torch's FSDP2 ``fully_shard`` applied to a model from outside.

    apply_fsdp(stage, [*stage.model.layers.values(), stage.model.embedding], mesh, param_dtype=torch.bfloat16)

Every parameter p of ``root`` (this rank's tp shard, [n, ...]: tensor parallelism inside is untouched)
becomes a DTensor sharded Shard(0) over the dp ranks: dp rank d keeps rows [d c, min((d + 1) c, n)),
c = ceil(n / dp). Each of ``blocks`` (the transformer layers; the embedding and the head) is one unit:
its weights are all-gathered just before its forward, freed after it, gathered again for its backward,
and its gradients are reduce-scattered over dp as soon as its backward is done. What is left of ``root``
is the root unit, gathered for the whole forward: that is where a tied embedding and head go, the head
reading the embedding's weight outside the embedding's own forward (``tpzoo.engine.fsdp_params``).
Under expert parallelism (ep > 1) each block's expert weights (``ep_split``: this ep rank's N/ep experts)
are a unit of their own, sharded over the expert-data-parallel ranks (``ParallelMesh.edp_mesh``, dp / ep
of them, which hold the same experts) and their gradients reduce-scattered over those: the expert
weights' sum over edp, as the other weights' over dp.

    per rank, between steps:   weights P / dp, gradients P / dp, optimizer state P / dp (float32 each)
    per rank, during a step:   + the root unit and one or two layers gathered, in ``param_dtype`` (FSDP keeps
                               the root gathered through the forward and prefetches the next layer on CUDA);
                               with m > 1 micro-batches + the float32 gradients, unsharded until the last
                               backward (no reduce per micro-batch); with pp > 1 + the whole stage gathered
                               from its first backward to the step's end (torch's pipeline stages turn
                               FSDP's reshard-after-backward off between micro-batches)

The sharded parameters stay float32: they are the main weights the optimizer steps. Compute runs in
``param_dtype`` (bf16/fp16: FSDP casts each gathered weight), gradients are reduced in ``reduce_dtype``
(float32) and summed, not averaged (divide factor 1): the engine's losses are already divided by the
global batch's counts. Accumulating over micro-batches without a reduce per micro-batch is
``sync_gradients_this_backward`` (pp = 1) or torch's pipeline stages (pp > 1, which recognise an FSDP root).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tpzoo.parallel.mesh import ParallelMesh
from tpzoo.parallel.param_facts import facts, mark


def local(t: Tensor) -> Tensor:
    """This rank's shard of ``t`` when it is a DTensor (a view: in-place changes reach ``t``), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def apply_fsdp(root: nn.Module, blocks: Iterable[nn.Module], mesh: ParallelMesh, *,
               param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype = torch.float32) -> None:
    """Shard ``root``'s parameters over ``mesh``'s dp axis (dp x cp; HSDP: ``mesh.fsdp_mesh``, sharded over dp /
    dp_replicate ranks, replicated over dp_replicate of them): each of ``blocks`` one FSDP unit, the rest of
    ``root`` the root unit (see module docstring). The parameters' ``param_facts`` (tp layout, tied and
    sequence-parallel sums) carry over to their sharded replacements. In place; ``root`` becomes an
    ``FSDPModule``."""
    if isinstance(root, FSDPModule):
        raise ValueError(f"{type(root).__name__} is already sharded with FSDP; apply_fsdp takes a freshly built module")
    kept = {name: facts(p) for name, p in root.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=None if param_dtype == torch.float32 else param_dtype,
                                  reduce_dtype=reduce_dtype)
    dp_mesh = mesh.fsdp_mesh  # dp x cp (its cp ranks hold the same weights); under HSDP (replicate, shard) of dp
    for block in blocks:
        for experts in _expert_modules(block) if mesh.ep_size > 1 else ():
            fully_shard(experts, mesh=mesh.edp_mesh, mp_policy=policy)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(root, mesh=dp_mesh, mp_policy=policy)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a divide factor is a PREMUL_SUM otherwise: not on gloo
    for name, p in root.named_parameters():
        mark(p, **dataclasses.asdict(kept[name]))


def _expert_modules(block: nn.Module) -> list[nn.Module]:
    """The modules of ``block`` holding expert weights split over ep (``param_facts``: ``ep_split``)."""
    return [m for m in block.modules() if any(facts(p).ep_split for p in m.parameters(recurse=False))]


def sync_gradients_this_backward(root: nn.Module, last: bool) -> None:
    """Before a micro-batch's backward (pp = 1): reduce-scatter the gradients only after the ``last`` one;
    before it they accumulate, unsharded and in ``reduce_dtype``. The weights are still freed after each
    unit's backward (regathered for the next micro-batch: memory over communication; torch's pipeline
    stages keep them gathered between micro-batches instead). Nothing for a module that is not sharded."""
    if isinstance(root, FSDPModule):
        root.set_requires_gradient_sync(last)
        root.set_is_last_backward(last)
