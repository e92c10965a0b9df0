"""Activation recompute, applied from outside: keep a block's inputs only, rerun its forward in backward.

    LayerRecompute(plan)     runs a model chunk's layers by the plan's ``recompute_units`` (tpzoo's
                             per-layer recompute, Megatron-LM's full uniform/block recompute): what
                             ``tpzoo.models.build_model`` makes a ``StagedModel``'s ``layer_runner``
    Recomputed(module, rng)  one module recomputed (selective recompute: the core attention, the
                             modules a sharding plan styles "heads"; put there by ``parallelize``)

``torch.utils.checkpoint`` restores the default generator for the rerun; ``recompute`` also replays
the mesh's RNG tracker streams (``mesh.rng``: the "tp" stream) from where the forward found them,
so dropout under ``mesh.rng.fork()`` draws the same masks twice. The layer may be a compiled module
(``tpzoo.models.compile``): the checkpoint and the replay run eagerly around it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tpzoo.parallel.random import RNGStatesTracker

if TYPE_CHECKING:
    from tpzoo.parallel.plan import ParallelPlan


class _Replay:
    """Sets the tracker's streams back to ``saved`` for the block, then restores them. Re-enterable:
    a zero-bubble schedule's split backward (input, then weights) recomputes a layer twice."""

    def __init__(self, tracker: RNGStatesTracker) -> None:
        self.tracker, self.saved, self.current = tracker, dict(tracker.states), {}

    def __enter__(self) -> None:
        self.current = dict(self.tracker.states)
        self.tracker.states.update(self.saved)

    def __exit__(self, *exc: object) -> None:
        self.tracker.states.update(self.current)


def _rng_contexts(tracker: RNGStatesTracker) -> tuple[AbstractContextManager, AbstractContextManager]:
    """For ``checkpoint(context_fn=...)``: nothing around the forward, the streams replayed around the rerun."""
    return nullcontext(), _Replay(tracker)


def recompute(block: Callable[..., Tensor], tracker: RNGStatesTracker, *args: Any) -> Tensor:
    """``block(*args)``, keeping only the inputs for backward and rerunning it there (non-reentrant)."""
    return checkpoint(block, *args, use_reentrant=False, context_fn=partial(_rng_contexts, tracker))


def run_span(layers: Sequence[nn.Module], hidden: Tensor, *args: Any) -> Tensor:
    """The layers in order on ``hidden``, each also given ``args`` (mask, cache): one recompute unit."""
    for layer in layers:
        hidden = layer(hidden, *args)
    return hidden


class LayerRecompute:
    """Runs a model chunk's layers by ``plan.recompute_units``: a recomputed span keeps only its input and
    reruns in backward (while training with grad on); the others run as they are."""

    def __init__(self, plan: ParallelPlan) -> None:
        self.plan = plan

    def __call__(self, layers: Sequence[nn.Module], hidden: Tensor, *args: Any, training: bool) -> Tensor:
        training = training and torch.is_grad_enabled()
        for first, end, rerun in self.plan.recompute_units(len(layers)):
            span = partial(run_span, layers[first:end])
            hidden = recompute(span, self.plan.mesh.rng, hidden, *args) if rerun and training else span(hidden, *args)
        return hidden


class Recomputed(nn.Module):
    """``module`` recomputed in backward while training with grad on. No parameters of its own."""

    def __init__(self, module: nn.Module, tracker: RNGStatesTracker) -> None:
        super().__init__()
        self.module, self.tracker = module, tracker

    def forward(self, *args: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            return recompute(self.module, self.tracker, *args)
        return self.module(*args)
