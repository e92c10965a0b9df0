"""Data parallelism: one bucketed gradient all-reduce (or, ZeRO-2, reduce-scatter) per global batch, and the
optimizer.

Every micro-batch's loss is sum(token losses) / (tokens of the whole global batch), so the gradient
of the global-batch loss is the plain SUM of the dp ranks' gradients (not DDP's mean):

    g = sum over dp ranks d, micro-batches k of  grad( sum_{t in (d, k)} loss_t ) / N_global

``GradReducer`` groups the main parameters (``mixed_precision``: float32 gradients) into buckets of
``bucket_mb`` MiB in reverse order (the order backward produces them). A parameter is ready once
it has had its m-th gradient accumulation of the step (``accumulated``, called from the model
parameter's post-accumulate-grad hook, ``MainParams.listeners``); a bucket whose parameters are
all ready starts its reduction at once, while backward still runs on earlier layers, always in
bucket order so every dp rank issues the same collectives in the same order. ``sync`` starts the
rest (parameters that got no gradient, or whose hook does not fire: the zero-bubble schedules
compute weight gradients apart, without it) and waits for all; ``overlapped`` counts the buckets
of the last step that started during backward.

The reduction of a bucket:

    all-reduce (ZeRO-1, plain dp)   flat bucket [n] summed over dp; every dp rank keeps every gradient
    reduce-scatter (ZeRO-2: ``owner``, the dp rank of each parameter, ``MainParams.owner``)
                                    input piece r = flat of the bucket's gradients owned by dp rank r
                                    (uneven sizes, 0 where r owns none of them); rank r receives the sum
                                    of its piece, copies it into its gradients and drops the others'
                                    (grad = None) as soon as they are sent: each rank ends the step
                                    holding its owned parameters' gradients only, ~1/dp of them

Expert weights split over ep are summed over their expert-data-parallel group instead of dp (``MainParams.groups``):
a bucket holds the parameters of one group, and every rank of a stage launches the buckets in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tpzoo.engine.config import EngineConfig
from tpzoo.parallel.fsdp import local


def _flat(grads: list[Tensor], device: torch.device) -> Tensor:
    return torch._utils._flatten_dense_tensors(grads) if grads else torch.zeros(0, device=device)


class GradReducer:
    """Sum over its group of each gradient of ``params``, once per step, overlapped with backward: all-reduced,
    or with ``owner`` (the rank, in its group, owning each of ``params``) reduce-scattered to the owners.
    ``groups``: each parameter's group (``MainParams.groups``), or one group for all."""

    def __init__(self, params: list[nn.Parameter], groups: list[dist.ProcessGroup] | dist.ProcessGroup,
                 bucket_mb: float, owner: list[int] | None = None) -> None:
        groups = groups if isinstance(groups, list) else [groups] * len(params)
        self.active = any(dist.get_world_size(g) > 1 for g in groups)
        self.owner = None if owner is None else {id(p): o for p, o in zip(params, owner, strict=True)}
        self.buckets: list[list[nn.Parameter]] = []
        self.groups: list[dist.ProcessGroup] = []  # each bucket's
        limit, size = bucket_mb * 2**20, float("inf")
        for p, group in zip(reversed(params), reversed(groups)):
            if size + p.numel() * p.element_size() > limit or group is not (self.groups or [None])[-1]:
                self.buckets.append([])
                self.groups.append(group)
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.expected, self.seen, self.ready, self.launched = 0, {}, [0] * len(self.buckets), 0
        self.pending: list[tuple[list[Tensor], Tensor, dist.Work, list[Tensor]]] = []
        self.overlapped = 0
        self.reduced_bytes = 0  # bytes all-reduced or reduce-scattered so far (their inputs)

    @property
    def sharded(self) -> bool:
        """Whether each dp rank ends the step holding only its owned parameters' gradients (ZeRO-2, dp > 1)."""
        return self.owner is not None and self.active

    def start(self, accumulations: int) -> None:
        """A new step in which each parameter's gradient is accumulated ``accumulations`` times."""
        self.expected, self.seen, self.ready, self.launched = accumulations, {}, [0] * len(self.buckets), 0
        self.pending = []

    def accumulated(self, p: nn.Parameter) -> None:
        """``p`` has had one more gradient accumulation of this step."""
        n = self.seen[id(p)] = self.seen.get(id(p), 0) + 1
        if n == self.expected:
            i = self.bucket_of[id(p)]
            self.ready[i] += 1
            while self.launched < len(self.buckets) and self.ready[self.launched] == len(self.buckets[self.launched]):
                self._launch()
            self._finish(done_only=True)

    def _launch(self) -> None:
        """Start the next bucket's reduction; pending: (gradients that receive the result, result, work, inputs)."""
        i, self.launched = self.launched, self.launched + 1
        held = [p for p in self.buckets[i] if p.grad is not None]
        device, group = self.buckets[i][0].device, self.groups[i]
        if dist.get_world_size(group) == 1:  # experts at ep = dp: no replica to sum with
            return
        if self.owner is None:
            grads = [p.grad for p in held]
            flat = _flat(grads, device)
            self.reduced_bytes += flat.numel() * flat.element_size()
            self.pending.append((grads, flat, dist.all_reduce(flat, group=group, async_op=True), []))
            return
        rank = dist.get_rank(group)
        pieces = [_flat([p.grad for p in held if self.owner[id(p)] == r], device)
                  for r in range(dist.get_world_size(group))]
        mine = [p.grad for p in held if self.owner[id(p)] == rank]
        for p in held:
            if self.owner[id(p)] != rank:
                p.grad = None  # its copy in ``pieces`` goes to its owner
        self.reduced_bytes += sum(piece.numel() * piece.element_size() for piece in pieces)
        out = torch.empty_like(pieces[rank])
        self.pending.append((mine, out, dist.reduce_scatter(out, pieces, group=group, async_op=True), pieces))

    def sync(self) -> None:
        """Start the buckets not started yet and wait for all: then the gradients hold their sums over dp
        (ZeRO-2: the owned ones; the others are None)."""
        if not self.active:
            return
        self.overlapped = self.launched
        while self.launched < len(self.buckets):
            self._launch()
        self._finish(done_only=False)

    def _finish(self, done_only: bool) -> None:
        """Copy the results of the pending reductions into their gradients and free their buffers, in launch
        order: those already done (during backward: the buffers of the finished ones go at once), or all."""
        while self.pending and (not done_only or self.pending[0][2].is_completed()):
            grads, flat, work, _ = self.pending.pop(0)
            work.wait()
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)


def build_optimizer(params: list[nn.Parameter], config: EngineConfig, device: torch.device) -> torch.optim.Optimizer:
    """The config's optimizer over ``params``, the main parameters this rank steps (``MainParams.owned``: with
    ``use_distributed_optimizer``, ZeRO-1 or -2, about 1/dp of them; FSDP: this rank's shards), so each dp rank
    keeps the main weights and optimizer state of its share only; the one place the engine builds it.

    ``adam``: AdamW, Megatron-LM's adam (decoupled weight decay: w -= lr (update + wd w)), betas
    (adam_beta1, adam_beta2), eps adam_eps. ``sgd``: SGD with momentum ``sgd_momentum``, weight decay added to
    the gradient (L2, as Megatron-LM's SGD). On CUDA AdamW's fused implementation (one kernel for the whole
    update); elsewhere the multi-tensor (``foreach``) one, the same update as the per-parameter loop to the last
    bit on CPU (checked against plain AdamW by tests/engine/test_engine.py)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, **hyperparameters(config), foreach=True)
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, **hyperparameters(config), **fast)


def hyperparameters(config: EngineConfig) -> dict[str, float | tuple[float, float]]:
    """The param-group settings of the config's optimizer (lr, weight decay; AdamW's betas and eps, SGD's
    momentum)."""
    if config.optimizer == "sgd":
        return dict(lr=config.lr, weight_decay=config.weight_decay, momentum=config.sgd_momentum)
    return dict(lr=config.lr, weight_decay=config.weight_decay, betas=(config.adam_beta1, config.adam_beta2),
                eps=config.adam_eps)


def set_hyperparameters(optimizer: torch.optim.Optimizer, config: EngineConfig) -> None:
    """Set every param group's ``hyperparameters`` to the config's (after loading a checkpoint, whose groups
    hold the saving run's: the flags of the resumed run win)."""
    for group in optimizer.param_groups:
        group.update(hyperparameters(config))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state (AdamW's moments and steps, SGD's momentum) held on this rank (a DTensor's: its
    local shard)."""
    return sum(local(t).numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t))


def gradient_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of the gradients ``params`` hold (the main parameters: after a ZeRO-2 step, the owned ones' only)."""
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
