"""The state one replica group hands another under per-step fault tolerance (``tpzoo.engine.fault_tolerance``): a
group that comes back takes a live group's weights and optimizer state from the peer rank that holds the same shards
(rank r of every group has the same mesh place), with no file in between.

    state = peer_state(engine)        # on the live group's rank r: its tensors, not copies (read before its update)
    load_peer_state(engine, state)    # on the returning group's rank r, after torchft moved it over

The state is this rank's parts only: the main weights it steps (``MainParams.owned``, float32; ZeRO's and FSDP's are
its dp shards), their optimizer state in the optimizer's order, its param groups' hyperparameters, the fp16 loss
scaler, the skipped-step counts and the RNG states (``tpzoo.checkpoint.rng``: the same mesh place, so dropout goes on
as in the live group). A DTensor travels as its local shard and is rebuilt on the parameter's placement.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from tpzoo.checkpoint.optimizer import install_states, param_groups, restore_param_groups
from tpzoo.checkpoint.rng import restore_rng, rng_items
from tpzoo.engine.train_step import Engine
from tpzoo.parallel.fsdp import local


def _stepped(engine: Engine) -> list[Tensor]:
    """The main weights this rank's optimizer steps, in its order."""
    return [p for group in engine.optimizer.param_groups for p in group["params"]]


def peer_state(engine: Engine) -> dict[str, Any]:
    """This rank's state for the peer that heals from it (module docstring)."""
    state, stepped = engine.optimizer.state, _stepped(engine)
    return dict(weights=[local(p).detach() for p in stepped],
                optimizer=[{k: local(v) if torch.is_tensor(v) else v for k, v in state[p].items()} if p in state
                           else None for p in stepped],
                param_groups=param_groups(engine.optimizer),
                loss_scaler=engine.scaler.state_dict() if engine.scaler is not None else None,
                steps=dict(bad_steps=engine.bad_steps, skipped_steps=engine.skipped_steps), rng=rng_items(engine.mesh))


def _placed(value: Any, p: Tensor) -> Any:
    """A copy of a received state value on ``p``'s device (never the sender's tensor: an optimizer updates its state
    in place); a DTensor like ``p`` where it is shaped like ``p``'s shard."""
    if not torch.is_tensor(value):
        return value
    value = value.to(p.device, copy=True)
    if isinstance(p, DTensor) and value.shape == p.to_local().shape:
        return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return value


@torch.no_grad()
def load_peer_state(engine: Engine, state: dict[str, Any], publish: bool = True) -> None:
    """Take a peer's ``peer_state``: ValueError naming the counts when it holds other weights than this rank
    steps (another model or mesh); then the main weights, published to the model (``publish=False``: the caller
    publishes, ``MainParams.publish``: a collective over dp under ZeRO), the optimizer state and the rest."""
    stepped = _stepped(engine)
    if len(state["weights"]) != len(stepped):
        raise ValueError(f"a peer replica group sent {len(state['weights'])} weights, this rank steps "
                         f"{len(stepped)}: the groups run other models or meshes; launch every group alike")
    for p, received in zip(stepped, state["weights"]):
        if received.shape != local(p).shape:
            raise ValueError(f"a peer replica group sent a weight of shape {list(received.shape)} where this rank "
                             f"holds {list(local(p).shape)}: the groups run other meshes; launch every group alike")
        local(p).copy_(received)
    if publish:
        engine.main.publish()
    install_states(engine, {p: {k: _placed(v, p) for k, v in s.items()}
                            for p, s in zip(stepped, state["optimizer"]) if s is not None})
    restore_param_groups(engine.optimizer, state["param_groups"])
    if engine.scaler is not None and state["loss_scaler"] is not None:
        engine.scaler.load_state_dict(state["loss_scaler"])
    engine.bad_steps, engine.skipped_steps = state["steps"]["bad_steps"], state["steps"]["skipped_steps"]
    restore_rng(engine.mesh, {key: t.clone() for key, t in state["rng"].items()})
