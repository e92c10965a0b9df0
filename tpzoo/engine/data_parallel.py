"""Data parallelism: one bucketed gradient all-reduce per global batch, and the optimizer.

Every micro-batch's loss is sum(token losses) / (tokens of the whole global batch), so the gradient
of the global-batch loss is the plain SUM of the dp ranks' gradients (not DDP's mean):

    g = sum over dp ranks d, micro-batches k of  grad( sum_{t in (d, k)} loss_t ) / N_global

``GradReducer`` groups the main parameters (``mixed_precision``: float32 gradients) into buckets of
``bucket_mb`` MiB in reverse order (the order backward produces them). A parameter is ready once
it has had its m-th gradient accumulation of the step (``accumulated``, called from the model
parameter's post-accumulate-grad hook, ``MainParams.listeners``); a bucket whose parameters are
all ready starts its all-reduce at once, while backward still runs on earlier layers, always in
bucket order so every dp rank issues the same collectives in the same order. ``sync`` starts the
rest (parameters that got no gradient, or whose hook does not fire: the zero-bubble schedules
compute weight gradients apart, without it) and waits for all; ``overlapped`` counts the buckets
of the last step that started during backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tpzoo.engine.config import EngineConfig


class GradReducer:
    """All-reduce (SUM) over ``group`` of the gradients of ``params``, once per step, overlapped with backward."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, bucket_mb: float) -> None:
        self.group = group
        self.active = dist.get_world_size(group) > 1
        self.buckets: list[list[nn.Parameter]] = []
        limit, size = bucket_mb * 2**20, float("inf")
        for p in reversed(params):
            if size + p.numel() * p.element_size() > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.expected, self.seen, self.ready = 0, {}, [0] * len(self.buckets)
        self.pending: list[tuple[int, torch.Tensor, dist.Work]] = []
        self.overlapped = 0

    def start(self, accumulations: int) -> None:
        """A new step in which each parameter's gradient is accumulated ``accumulations`` times."""
        self.expected, self.seen, self.ready, self.pending = accumulations, {}, [0] * len(self.buckets), []

    def accumulated(self, p: nn.Parameter) -> None:
        """``p`` has had one more gradient accumulation of this step."""
        n = self.seen[id(p)] = self.seen.get(id(p), 0) + 1
        if n == self.expected:
            i = self.bucket_of[id(p)]
            self.ready[i] += 1
            while len(self.pending) < len(self.buckets) and self.ready[len(self.pending)] == len(
                    self.buckets[len(self.pending)]):
                self._launch(len(self.pending))

    def _launch(self, i: int) -> None:
        grads = [p.grad for p in self.buckets[i] if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads) if grads else torch.zeros(0, device=self.buckets[i][0].device)
        self.pending.append((i, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def sync(self) -> None:
        if not self.active:
            return
        self.overlapped = len(self.pending)
        for i in range(len(self.pending), len(self.buckets)):
            self._launch(i)
        for i, flat, work in self.pending:
            work.wait()
            grads = [p.grad for p in self.buckets[i] if p.grad is not None]
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)


def build_optimizer(params: list[nn.Parameter], config: EngineConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over ``params``, the main parameters this rank steps (``MainParams.owned``: with
    ``use_distributed_optimizer``, ZeRO-1, about 1/dp of them, so each dp rank keeps the main weights and
    AdamW state of its share only).

    On CUDA the fused implementation (one kernel for the whole update); elsewhere the multi-tensor
    (``foreach``) one, the same update as the per-parameter loop to the last bit on CPU (checked against
    plain AdamW by tests/engine/test_engine.py)."""
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, eps=config.adam_eps, **fast)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state (AdamW's moments and steps) held on this rank."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t))
