"""What a mixture of experts' layers record in a training step, for the engine (``tpzoo.engine.train_step``) to sum
with the loss and log: each router loss (``tpzoo.models.moe.ROUTER_LOSSES``, weighed per sequence so that it counts
once whatever the mesh) and the token slots each expert took (``EXPERT_LOAD``). The modules are found once, when the
engine is built (``sequence_loss_modules``, ``expert_layers``)."""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from tpzoo.models.moe import EXPERT_LOAD, ROUTER_LOSSES

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a transformer layer's module path, its global number


def sequence_loss_modules(chunks: list[nn.Module]) -> list[nn.Module]:
    """The modules that add losses of their own per sequence (``sequence_weight`` and ``losses``: a mixture of
    experts' router losses, ``tpzoo.models.moe``), found once when the engine is built."""
    return [m for chunk in chunks for m in chunk.modules() if hasattr(m, "sequence_weight")]


def weigh_sequences(modules: list[nn.Module], weight: float) -> None:
    """Give each of ``modules`` (``sequence_loss_modules``) the weight the step's training loss gives one sequence:
    the loss scale over the global batch's sequences, on every rank and stage, so that their losses count once
    whatever the mesh; and empty what they recorded (``losses``)."""
    for module in modules:
        module.sequence_weight, module.losses = weight, {}


def recorded_losses(modules: list[nn.Module], device: torch.device) -> Tensor:
    """[K + 1]: the sums over ``modules`` of the ``ROUTER_LOSSES`` they recorded this step (each a sum over
    sequences), and how many recorded them; zeros on a rank without any (every rank sends this shape)."""
    recorded = [m.losses for m in modules if m.losses]
    sums = [sum((r[name] for r in recorded), torch.zeros((), device=device)) for name in ROUTER_LOSSES]
    return torch.stack([*sums, torch.tensor(float(len(recorded)), device=device)]).float()


def expert_layers(chunks: list[nn.Module]) -> list[tuple[int, nn.Module]]:
    """(global layer number, module) of the modules in ``chunks`` that record an expert load (``EXPERT_LOAD``: a
    mixture of experts), the number read from the ``layers.<i>.`` of the module's name."""
    found = [(LAYER.search(f"{name}."), m) for chunk in chunks for name, m in chunk.named_modules()
             if hasattr(m, "sequence_weight")]
    return [(int(match[1]), m) for match, m in found if match]


def recorded_loads(layers: list[tuple[int, nn.Module]], shape: tuple[int, int], device: torch.device) -> Tensor:
    """[L N] flattened: the token slots routed to each expert of each layer this step (``EXPERT_LOAD``), this rank's
    layers (``expert_layers``) in their rows, zeros elsewhere; [0] when ``shape`` (layers, experts) is empty."""
    out = torch.zeros(shape, device=device)
    for i, module in layers:
        if EXPERT_LOAD in module.losses:
            out[i] += module.losses[EXPERT_LOAD]
    return out.flatten()


def router_means(values: list[float], sequences: int, dp: int) -> dict[str, float]:
    """``ROUTER_LOSSES`` per sequence and layer from ``recorded_losses`` summed over pp and dp (which counts each
    layer dp times); {} when no layer recorded any."""
    *sums, layers = values
    layers /= dp
    return {name: v / sequences / layers for name, v in zip(ROUTER_LOSSES, sums)} if layers else {}
