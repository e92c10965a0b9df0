"""Local SGD over dp (``EngineConfig.local_sgd_steps`` H, ``outer_lr``; --local-sgd-steps): data parallelism for
networks too slow to sum the gradients every step. It changes the math: docs/elastic.md says how.

Each dp replica steps on its own gradients (no gradient all-reduce), scaled by dp so that the replicas' mean
move is plain dp's: with g_d the gradient of replica d's share of the global batch (``train_step``: each share's
loss is over the tokens of the whole batch, so plain dp steps on sum_d g_d), replica d steps on dp x g_d. After
every H updates the replicas average how far they moved from the weights of the last outer step A (one all-reduce
of one flat tensor of the main weights, instead of H of the gradients) and take an outer SGD step from there:

    Delta = mean_d (A - W_d)        A <- A - outer_lr x Delta        W_d <- A (every replica)

With H = 1, outer_lr = 1 and an optimizer linear in the gradient (SGD, its momentum and L2 weight decay; no
clipping) this is plain dp; with H > 1 each outer step costs the bytes of one gradient all-reduce, so dp sends H
times fewer. The optimizer's own state (momentum, AdamW's moments) stays each replica's own. ``finish`` takes the
outer step at once (before a save: a checkpoint holds the replicas' common weights).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class LocalSGD:
    """The outer steps of ``params`` (the main weights the optimizer updates) over ``group`` (dp)."""

    def __init__(self, params: list[Tensor], group: dist.ProcessGroup, every: int, lr: float) -> None:
        self.params, self.group, self.every, self.lr = params, group, every, lr
        self.anchor: list[Tensor] | None = None  # A: taken at the first step (after a checkpoint is loaded)
        self.updates = 0       # inner updates since A
        self.reduced_bytes = 0  # bytes all-reduced by the outer steps

    def begin(self) -> None:
        """Before a step: the weights of the last outer step, if none yet."""
        if self.anchor is None:
            self.anchor = [p.detach().clone() for p in self.params]

    def step(self) -> bool:
        """After an inner update: the outer step when H updates were made since the last; whether it was taken."""
        self.updates += 1
        return self.updates >= self.every and self.finish()

    @torch.no_grad()
    def finish(self) -> bool:
        """The outer step now, if any update was made since the last (collective over dp)."""
        if self.anchor is None or self.updates == 0:
            return False
        moves = torch._utils._flatten_dense_tensors([a - p for a, p in zip(self.anchor, self.params)])
        dist.all_reduce(moves, group=self.group)
        self.reduced_bytes += moves.numel() * moves.element_size()
        moves /= dist.get_world_size(self.group)
        for a, p, move in zip(self.anchor, self.params, torch._utils._unflatten_dense_tensors(moves, self.anchor)):
            a.sub_(move, alpha=self.lr)
            p.copy_(a)
        self.updates = 0
        return True

