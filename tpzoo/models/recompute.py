"""Activation recompute of a layer, a span of layers or a block's part: keep its inputs only, rerun its
forward in backward. Which spans a model chunk recomputes is its plan's (``ParallelPlan.recompute_units``:
tpzoo's per-layer recompute and Megatron-LM's full uniform/block recompute, applied by
``StagedModel.run_layers``); selective recompute reruns the core attention only (``ParallelAttention``).

``torch.utils.checkpoint`` restores the default generator for the rerun; ``recompute`` also replays
the mesh's RNG tracker streams (``mesh.rng``: the "tp" stream) from where the forward found them,
so dropout under ``mesh.rng.fork()`` draws the same masks twice. The layer may be a compiled module
(``tpzoo.models.compile``): the checkpoint and the replay run eagerly around it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, Callable, Sequence

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tpzoo.parallel import RNGStatesTracker


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


def recompute(layer: Callable[..., Tensor], tracker: RNGStatesTracker, *args: Any) -> Tensor:
    """``layer(*args)``, keeping only the inputs for backward and rerunning it there (non-reentrant)."""
    return checkpoint(layer, *args, use_reentrant=False, context_fn=partial(_rng_contexts, tracker))


def run_span(layers: Sequence[nn.Module], hidden: Tensor, *args: Any) -> Tensor:
    """The layers in order on ``hidden``, each also given ``args`` (mask, cache): one recompute unit."""
    for layer in layers:
        hidden = layer(hidden, *args)
    return hidden
