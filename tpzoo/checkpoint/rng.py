"""Per-rank random state in a checkpoint: "rng.<global rank>.cpu" (the default CPU generator),
".cuda" (the rank's CUDA generator, when on a GPU) and ".tracker.<stream>" (``mesh.rng``: the "tp"
dropout stream). Every rank writes its own; they are restored only onto the same mesh shape, where
global rank r has the same (pp, dp, tp) coordinates and so the same streams (``load``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tpzoo.parallel import ParallelMesh

TRACKER = "tracker."


def _prefix() -> str:
    return f"rng.{dist.get_rank()}."


def rng_items(mesh: ParallelMesh) -> dict[str, Tensor]:
    """This rank's generator states (uint8 tensors) by checkpoint key."""
    items = {_prefix() + "cpu": torch.get_rng_state()}
    if mesh.device.type == "cuda":
        items[_prefix() + "cuda"] = torch.cuda.get_rng_state(mesh.device)
    for name, (_, state) in mesh.rng.states.items():
        items[_prefix() + TRACKER + name] = state.clone()
    return items


def rng_targets(saved: dict[str, object]) -> dict[str, Tensor]:
    """Empty tensors for this rank's saved states (``saved``: ``Metadata.state_dict_metadata``)."""
    return {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in saved.items()
            if key.startswith(_prefix()) and isinstance(meta, TensorStorageMetadata)}


def restore_rng(mesh: ParallelMesh, loaded: dict[str, Tensor]) -> None:
    """Set the generators (and ``mesh.rng`` streams) from ``rng_targets`` once filled."""
    for key, state in loaded.items():
        what = key[len(_prefix()):]
        if what == "cpu":
            torch.set_rng_state(state)
        elif what == "cuda":
            torch.cuda.set_rng_state(state, mesh.device)
        else:
            name = what[len(TRACKER):]
            device = mesh.rng.states[name][0] if name in mesh.rng.states else mesh.device
            mesh.rng.states[name] = (device, state)
