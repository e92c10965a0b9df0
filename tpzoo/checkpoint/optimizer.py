"""Optimizer state in a checkpoint: each parameter's state (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``)
keyed "optim.<global parameter name>.<state name>", tensors shaped like the parameter stored like it
(``tensors``), scalars (``step``) as plain replicated tensors. Under FSDP the parameters and their
state are DTensors sharded over dp (each rank holds its rows): stored the same way, and loaded into
new DTensors of the parameter's placement (``zeros_like``) that become the state.

The state is that of the main parameters (``tpzoo.engine.mixed_precision``: float32 whatever the
precision), stored under their model parameters' names. The layout does not depend on dp, ZeRO-1
or tp: under ZeRO-1 each dp rank holds the state of the parameters it owns and writes just those;
at load each rank fills the state of the parameters it owns now, whatever dp and ZeRO setting
wrote them. The two copies of a
tied word embedding (first and last pipeline stage) step alike, so the first stage's state is saved
and both load it. The param groups' hyperparameters (lr, betas, ...) go to meta.json.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tpzoo.checkpoint.tensors import Entry, entry
from tpzoo.engine.train_step import Engine
from tpzoo.models.sharding import TIED_COPY, expert_names, full_shape, source_name, tp_partitions

logger = logging.getLogger(__name__)
OPTIM_PREFIX = "optim."
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def _named_parameters(engine: Engine) -> Iterator[tuple[str, nn.Parameter, tuple[int, int] | None, int]]:
    """(global name, main parameter, tp partition, ep size of an expert weight else 1) of every parameter of this
    rank's chunks."""
    for chunk in engine.chunks:
        partitions, experts = tp_partitions(chunk.model, engine.mesh.tp_size), expert_names(chunk.model)
        for name, p in chunk.model.named_parameters():
            yield name, engine.main.main_of(p), partitions.get(name), engine.mesh.ep_size if name in experts else 1


def optimizer_entries(engine: Engine) -> list[Entry]:
    """The state this rank holds, for saving (none before the first step)."""
    state = engine.optimizer.state
    return [entry(f"{OPTIM_PREFIX}{name}.{key}", value, *((partition, ep) if value.shape == p.shape else (None, 1)))
            for name, p, partition, ep in _named_parameters(engine) if name != TIED_COPY and p in state
            for key, value in state[p].items() if torch.is_tensor(value)]


def optimizer_targets(engine: Engine, saved: dict[str, Any]) -> tuple[list[Entry], dict[nn.Parameter, dict]]:
    """For loading: entries over new state tensors for every parameter this rank's optimizer steps now
    and the checkpoint holds state of, and those states (parameter -> {state name: tensor}) to install
    once filled. ``saved``: the checkpoint's ``Metadata.state_dict_metadata``."""
    by_param: dict[str, dict[str, TensorStorageMetadata]] = defaultdict(dict)
    for key, meta in saved.items():
        if key.startswith(OPTIM_PREFIX) and isinstance(meta, TensorStorageMetadata):
            name, _, state_name = key[len(OPTIM_PREFIX):].rpartition(".")
            by_param[name][state_name] = meta
    owned = {p for group in engine.optimizer.param_groups for p in group["params"]}
    entries, states = [], {}
    for name, p, partition, ep in _named_parameters(engine):
        if p not in owned or source_name(name) not in by_param:
            continue
        states[p] = {}
        for state_name, meta in by_param[source_name(name)].items():
            like_param = tuple(meta.size) == full_shape(p.shape, partition, ep)
            t = (torch.zeros_like(p, memory_format=torch.contiguous_format) if like_param
                 else torch.zeros(tuple(meta.size), dtype=meta.properties.dtype))
            states[p][state_name] = t
            entries.append(entry(f"{OPTIM_PREFIX}{source_name(name)}.{state_name}", t,
                                 *((partition, ep) if like_param else (None, 1))))
    return entries, states


def install_states(engine: Engine, states: dict[nn.Parameter, dict[str, Tensor]]) -> None:
    """Replace the optimizer state of the loaded parameters. AdamW's ``step`` goes where the update reads
    it, as ``Optimizer.load_state_dict`` would put it: a float32 scalar on the parameter's device for a
    fused or capturable group (the engine's fused AdamW on CUDA), on the host otherwise."""
    group_of = {p: group for group in engine.optimizer.param_groups for p in group["params"]}
    for p, state in states.items():
        if group_of[p].get("fused") or group_of[p].get("capturable"):
            state = {k: v.to(device=p.device, dtype=torch.float32) if k == "step" else v for k, v in state.items()}
        engine.optimizer.state[p] = state


def param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The JSON-able hyperparameters of each param group (everything but the parameters)."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups]


def restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """Set the saved hyperparameters (lr, betas, ...) on the optimizer's groups; not how the update runs
    (``IMPLEMENTATION``: fused on CUDA, foreach elsewhere, chosen by the device that resumes)."""
    if len(saved) != len(optimizer.param_groups):
        logger.warning("checkpoint has %d optimizer param groups, the optimizer %d: hyperparameters not restored",
                       len(saved), len(optimizer.param_groups))
        return
    for group, values in zip(optimizer.param_groups, saved):
        for k, v in values.items():
            if k in group and k not in IMPLEMENTATION:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
