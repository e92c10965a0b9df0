"""Random streams for dropout under tensor parallelism.

Activations that every tp rank holds in full (the residual stream, LayerNorm outputs) must see
the *same* dropout mask on every tp rank, or the replicas drift apart; activations that are split
across tp ranks (attention heads, the MLP's hidden features) must see *different* masks, or each
shard repeats the others' pattern. So there are two streams:

    default stream   seed + 100 * pp_rank + C cp_rank          same on every tp (and dp) rank
    "tp" stream      the default's seed + 2718 + tp_rank        different on every tp rank

(C = 1,000,003: the cp ranks of context parallelism hold different tokens of a sequence, so each draws its own
masks; at cp 1 the streams are what they always were.)

Dropout inside a tensor-parallel region runs under ``mesh.rng.fork("tp")`` (``TPRandom``, which
``tpzoo.parallel.parallelize`` puts around such modules). Weights are not drawn
from these streams: layers build their full weight from the default generator under a seed the
caller sets (models seed each layer from (seed, layer index)), so tp and pp never change them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from tpzoo.parallel.mesh import ParallelMesh

TP_STREAM = "tp"
TP_SEED_OFFSET = 2718
CP_SEED_STRIDE = 1_000_003  # each cp rank its own streams (module docstring)


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that code can fork into; Megatron's CudaRNGStatesTracker for any device."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[torch.device, torch.Tensor]] = {}
        self.active: str | None = None  # the stream a fork runs in now

    def add(self, name: str, seed: int, device: torch.device | str = "cpu") -> None:
        """Register stream ``name`` seeded with ``seed`` for the default generator of ``device``."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.states[name] = (device, torch.Generator(device).manual_seed(seed).get_state())

    @contextmanager
    def fork(self, name: str = TP_STREAM) -> Iterator[None]:
        """Run the block with the default generator swapped for stream ``name``; resume it after. Inside a fork
        of the same stream (a dropout within a module already run in it) the block just runs on."""
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never added; known: {sorted(self.states)}. "
                           f"Call tpzoo.parallel.manual_seed(seed) after init_mesh")
        if self.active == name:
            yield
            return
        device, state = self.states[name]
        outer, around = _get_state(device), self.active
        _set_state(device, state)
        self.active = name
        try:
            yield
        finally:
            self.active = around
            self.states[name] = (device, _get_state(device))
            _set_state(device, outer)


def manual_seed(seed: int, mesh: ParallelMesh | None = None) -> None:
    """Seed the default stream and the mesh's "tp" stream (see the module docstring)."""
    from tpzoo.parallel.mesh import get_mesh

    mesh = mesh or get_mesh()
    base = seed + 100 * mesh.pp_rank + CP_SEED_STRIDE * getattr(mesh, "cp_rank", 0)
    torch.manual_seed(base)
    mesh.rng.add(TP_STREAM, base + TP_SEED_OFFSET + mesh.tp_rank, mesh.device)


@torch.compiler.disable  # swaps generator states, which dynamo cannot trace: compiled blocks call it eagerly
def in_tp_stream(tracker: RNGStatesTracker, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` drawing its random numbers from the "tp" stream of ``tracker`` (a mesh's
    ``rng``): dropout on activations split across the tp ranks, each rank its own mask."""
    with tracker.fork():
        return fn(*args, **kwargs)


class TPRandom(nn.Module):
    """``module`` drawing its random numbers from the tp stream while training (dropout on activations
    split over tp: heads, features or sequence shards). A module whose dropout ``p`` is 0 draws nothing
    and runs as it is (so that torch.compile keeps it in its graph). No parameters of its own."""

    def __init__(self, module: nn.Module, tracker: RNGStatesTracker) -> None:
        super().__init__()
        self.module, self.tracker = module, tracker

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and getattr(self.module, "p", 1.0) > 0:
            return in_tp_stream(self.tracker, self.module, *args, **kwargs)
        return self.module(*args, **kwargs)
