"""Whether a run's model fits this machine, estimated before anything is allocated, so that a model too large
for it is refused in one line naming the sizes instead of dying in the allocator minutes later (the data's
sample index: ``tpzoo.machine.check_index_fits``).

    check_state_fits(config, engine_config, mesh)   # before the model is built (tpzoo.training.setup.build_run)

The model's state per rank: the family's parameter count (``num_parameters``) with the vocabulary padded as the
embedding pads it, times the bytes each parameter keeps (weights and gradients in the precision's dtype, float32
main weights apart from bf16/fp16 ones, the optimizer's float32 moments), over tp x pp; the main weights and the
moments also over dp with the distributed optimizer, everything with FSDP. Activations are not counted: what is
refused cannot fit even without them. It is compared with the memory of one device (a GPU's; the host's on the
CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpzoo.engine.config import EngineConfig
from tpzoo.machine import gib, host_memory
from tpzoo.models.config import ModelConfig
from tpzoo.models.presets import num_parameters
from tpzoo.parallel import ParallelMesh, padded_vocab_size

WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def device_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, name) of the memory one rank's tensors live in."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the {props.name}'s"
    return host_memory(), "this machine's"


def estimated_state_bytes(config: ModelConfig, engine: EngineConfig, mesh: ParallelMesh, fsdp: bool = False) -> tuple[int, int]:
    """(parameters, bytes per rank) of the model's weights, gradients, main weights and optimizer state."""
    vocab = padded_vocab_size(config.vocab_size, mesh.tp_size, config.make_vocab_size_divisible_by)
    params = num_parameters(config.replace(vocab_size=vocab))
    weight = WEIGHT_BYTES[engine.precision]
    moments = 8 if engine.optimizer == "adam" else 4 * (engine.sgd_momentum > 0)
    optimizer = (4 if weight != 4 else 0) + moments  # main weights apart from the weights, and the moments
    shards = dist.get_world_size(mesh.fsdp_group) if fsdp else 1  # FSDP: over dp x cp (HSDP: its shard ranks)
    spread = mesh.dp_cp_size if engine.use_distributed_optimizer else shards  # ZeRO shards over dp x cp
    per_param = 2 * weight / shards + optimizer / spread
    return params, int(params * per_param / (mesh.tp_size * mesh.pp_size))


def check_state_fits(config: ModelConfig, engine: EngineConfig, mesh: ParallelMesh, fsdp: bool = False) -> None:
    """ValueError when the model's state per rank (``estimated_state_bytes``) exceeds one device's memory."""
    params, need = estimated_state_bytes(config, engine, mesh, fsdp)
    have, whose = device_memory(mesh.device)
    if need > have:
        vocab = padded_vocab_size(config.vocab_size, mesh.tp_size, config.make_vocab_size_divisible_by)
        raise ValueError(f"the model has {params:,} parameters ({config.num_layers:,} layers, hidden "
                         f"{config.hidden_size:,}, vocabulary padded to {vocab:,}): {gib(need)} per rank of weights, "
                         f"gradients and optimizer state at tp {mesh.tp_size} x pp {mesh.pp_size}, more than {whose} "
                         f"{gib(have)}; make it smaller (--num-layers, --hidden-size, --make-vocab-size-divisible-by) "
                         f"or spread it over more ranks (--tp, --pp)")
