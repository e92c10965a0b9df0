"""Megatron-style mixed precision: the model's weights and gradients in bf16 (fp16), fp32 main weights
and gradients around the optimizer, and the distributed optimizer's split of the main weights (ZeRO-1;
ZeRO-2 also splits the main grads: ``data_parallel.GradReducer``) over dp.

Each model parameter p has a *main* parameter, the one the rest of the step works on:

    precision   model weight, grad   main grad (one per p)        main weight
    fp32        float32              p.grad itself                 p itself
    bf16/fp16   bf16 / fp16          float32, main.grad            float32 copy of p's initial value,
                                                                   on the dp rank that owns p (ZeRO-1) or on all
    frozen p    its dtype            none                          p itself: no float32 copy (LoRA's base weights
                                                                   never step; a checkpoint holds them in float32,
                                                                   cast from p, and a load casts them back)

    per micro-batch  p's post-accumulate-grad hook: main.grad += p.grad (in float32); p.grad = None
    after backward   dp all-reduce (ZeRO-2: reduce-scatter, each dp rank keeps its owned parameters' main
                     grads only), tied-embedding and sequence-parallel sums, fp16 unscaling and overflow
                     check, norm and clipping: all on the float32 main grads
    optimizer step   AdamW on the main weights this rank owns, then ``publish``: model weight = main
                     weight (cast), and under ZeRO-1/2 each owner broadcasts its model weights over dp

Expert weights split over ep (``facts(p).ep_split``, ``tpzoo.parallel.experts``) are held alike by the ranks of
the expert-data-parallel group only (edp, dp / ep of them): their owners, gradient sums and broadcasts are over it.

The model's forward and backward never cast a weight. A main parameter carries its model parameter's
``param_facts`` (norm counting, tied and sequence-parallel sums read them). Under ZeRO-1/2 the main
parameter of a p owned by another dp rank is a stand-in whose data is one expanded zero (no memory):
only its grad is used (ZeRO-2 drops that grad once it is sent to its owner). The zero-bubble schedules
assign weight gradients without the hook (torch's ``stage_backward_weight`` adds them into p.grad, in
the model's dtype); ``flush`` moves them over.

Why not torch's ``ZeroRedundancyOptimizer`` (used here before): it shards the optimizer *state* but
steps and broadcasts the very parameters it is given, so over float32 main weights every dp rank would
keep all of them (4 bytes per parameter on every rank instead of 4/dp), and it cannot broadcast the
bf16 model weights in their place. Owning whole parameters per dp rank keeps float32 ZeRO-1 runs
equal to the single-rank run (the engine's same-loss tests), as they were with it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from tpzoo.parallel.param_facts import facts, mark

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def owners(params: list[nn.Parameter], ranks: int) -> list[int]:
    """The dp rank owning each parameter under the distributed optimizer (ZeRO-1 and -2): parameters marked
    ``pp_tied`` (the word embedding and its copy in the last stage's head) dp rank 0 on every stage, so
    that under ZeRO-2 both copies' gradients sit at the same dp coordinate for their sum over first+last
    stage; the rest largest first, each to the rank holding the fewest elements so far (ties: the lower
    rank). The same on every tp and dp rank, since it depends on shapes and facts only."""
    load, out = [0] * ranks, [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (not facts(params[i]).pp_tied, -params[i].numel())):
        out[i] = 0 if facts(params[i]).pp_tied else min(range(ranks), key=lambda r: load[r])
        load[out[i]] += params[i].numel()
    return out


def _main_of(p: nn.Parameter, owned: bool) -> nn.Parameter:
    """A float32 main parameter for ``p`` with its facts: a copy of its value, or a stand-in when not owned."""
    data = p.detach().clone() if owned else torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)
    return mark(nn.Parameter(data, requires_grad=False), **dataclasses.asdict(facts(p)))


class MainParams:
    """The main parameters of ``params`` (the model parameters of this rank, float32 when built) for a
    run at ``precision``: casts the model parameters to its dtype and hooks their gradients.

    ``params[i]``: the main parameter of model parameter i; ``owned``: those this rank steps (under
    ``zero``, the ones ``owners`` gives this dp rank; otherwise all); ``chunks``: per model chunk
    (``modules``), a module whose parameters are its main parameters, in the chunk's order;
    ``listeners``: called with a main parameter after each accumulation into its grad. A frozen
    parameter (``requires_grad`` False: the base weights under LoRA) is its own main parameter on every rank
    (no float32 copy), with no owner, no gradient and no optimizer state; ``trainable`` / ``trainable_owner``: the
    others and their dp owners (what the gradient reducer sums)."""

    def __init__(self, params: list[nn.Parameter], modules: list[nn.Module], precision: str,
                 dp_group: dist.ProcessGroup, zero: bool, edp_group: dist.ProcessGroup | None = None) -> None:
        self.model, self.dtype = params, DTYPES[precision]
        edp_group = dp_group if edp_group is None else edp_group
        # each parameter's group: the ranks holding it alike, over which it is owned, summed and broadcast
        self.groups = [edp_group if facts(p).ep_split else dp_group for p in params]
        dp, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        trains = [p.requires_grad for p in params]
        self.owner: list[int | None] = [None] * len(params)
        for group in {id(g): g for g in self.groups}.values():  # each group's learned parameters spread over it
            learned = [i for i, p in enumerate(params) if trains[i] and self.groups[i] is group]
            given = owners([params[i] for i in learned], dist.get_world_size(group)) if zero else \
                [dist.get_rank(group)] * len(learned)
            for i, o in zip(learned, given):
                self.owner[i] = o
        mine = [o is not None and o == dist.get_rank(g) for o, g in zip(self.owner, self.groups)]
        if any(trains) and not any(mine):
            raise ValueError(f"the distributed optimizer over dp={dp} leaves dp rank {rank} no parameter to own: "
                             f"this pipeline stage trains {sum(trains)} parameters; lower dp or turn off "
                             f"use_distributed_optimizer")
        self.zero, self.mixed = zero and dp > 1, self.dtype != torch.float32
        self.params = [_main_of(p, m) if self.mixed and t else p for p, m, t in zip(params, mine, trains)]
        self.owned = [main for main, m in zip(self.params, mine) if m]
        self.trainable = [main for main, t in zip(self.params, trains) if t]
        self.trainable_owner = [o for o in self.owner if o is not None]
        self.trainable_group = [g for g, t in zip(self.groups, trains) if t]
        self._kept = {id(main) for main, m, t in zip(self.params, mine, trains) if m or not t}  # weights() holds
        self._mine = [(p, main) for p, main, m in zip(params, self.params, mine) if m]
        self._main_of = {id(p): main for p, main in zip(params, self.params)}
        self.chunks = [nn.ParameterList([self.main_of(p) for p in module.parameters()]) for module in modules]
        self.listeners: list[Callable[[nn.Parameter], None]] = []
        self._loaded: list[tuple[nn.Parameter, torch.Tensor]] = []  # frozen p, its float32 value loaded (weights)
        for p, main, t in zip(params, self.params, trains):
            if self.mixed:
                p.data = p.data.to(self.dtype)
            if t:
                p.register_post_accumulate_grad_hook(lambda p, main=main: self._accumulated(p, main))

    def main_of(self, p: nn.Parameter) -> nn.Parameter:
        """The main parameter of model parameter ``p``."""
        return self._main_of[id(p)]

    def _accumulated(self, p: nn.Parameter, main: nn.Parameter) -> None:
        if main is not p:
            _move_grad(p, main)
        for listener in self.listeners:
            listener(main)

    def flush(self) -> None:
        """Move gradients left in the model parameters (zero-bubble weight gradients) into the main grads."""
        for p, main in zip(self.model, self.params):
            if main is not p and p.grad is not None:
                _move_grad(p, main)

    def abandon_step(self) -> None:
        """After a forward or backward that raised: nothing to reset (``zero_grad`` starts the next step)."""

    def zero_grad(self) -> None:
        for p, main in zip(self.model, self.params):
            p.grad = main.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """Model weights = main weights: each rank casts the ones it owns, then under ZeRO-1 every dp rank
        broadcasts its model weights (one flat tensor in the model's dtype) to the others; frozen weights take the
        values a load gave them (``weights(loading=True)``)."""
        for p, value in self._loaded:
            p.copy_(value)
        self._loaded.clear()
        if self.mixed:
            torch._foreach_copy_([p for p, _ in self._mine], [main for _, main in self._mine])
        if not self.zero:
            return
        shared = [g for g in {id(g): g for g in self.groups}.values() if dist.get_world_size(g) > 1]  # at ep = dp
        for group in shared:                                                  # the experts' groups are 1 rank
            for r in range(dist.get_world_size(group)):
                theirs = [p for p, o, g in zip(self.model, self.owner, self.groups) if o == r and g is group]
                flat = torch._utils._flatten_dense_tensors([p.detach() for p in theirs])
                dist.broadcast(flat, src=dist.get_global_rank(group, r), group=group)
                torch._foreach_copy_(theirs, torch._utils._unflatten_dense_tensors(flat, theirs))

    def weights(self, model: nn.Module, loading: bool = False) -> dict[str, torch.Tensor | None]:
        """Parameter name -> its main weight (detached) for each parameter of ``model`` (a chunk's model), None
        where another dp rank owns it (a frozen one every rank holds): what a checkpoint stores of the model, and
        fills at load (``loading``). A frozen weight under mixed precision is a float32 copy of it, which a load
        fills and ``publish`` casts into it."""
        out: dict[str, torch.Tensor | None] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            main = self.main_of(p)
            if self.mixed and main is p:  # frozen
                out[name] = p.detach().float()
                if loading:
                    self._loaded.append((p, out[name]))
            else:
                out[name] = main.detach() if id(main) in self._kept else None
        return out


def _move_grad(p: nn.Parameter, main: nn.Parameter) -> None:
    if main.grad is None:
        main.grad = p.grad.float()
    else:
        main.grad.add_(p.grad)
    p.grad = None
