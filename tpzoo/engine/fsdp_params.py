"""The main parameters of an FSDP run: the sharded parameters themselves (``tpzoo.parallel.fsdp``).

``MainParams`` keeps float32 main weights beside bf16/fp16 model weights and moves each micro-batch's
gradient over; under FSDP the model's parameters already are float32 shards (DTensor, Shard(0) over dp;
the expert weights' over edp: ``tpzoo.parallel.fsdp``) whose gradients FSDP reduce-scatters in float32,
while the compute casts come from its ``MixedPrecisionPolicy``. So the main parameter of p is p, every rank steps all of its own shards (the
optimizer state is sharded alike), and there is nothing to publish: the next forward gathers the
updated shards. Same interface as ``MainParams``, for the engine and the checkpoint code.
"""

from __future__ import annotations

import torch
from torch import nn

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.mixed_precision import DTYPES
from tpzoo.models.base import StagedModel
from tpzoo.parallel import ParallelMesh
from tpzoo.parallel.fsdp import apply_fsdp


def check_fsdp(config: EngineConfig, mesh: ParallelMesh) -> None:
    """ValueError, before any work, for what FSDP cannot be combined with:

    - the distributed optimizer: FSDP already shards the optimizer state (and the gradients) over dp;
    - interleaved-zero-bubble with pp > 1: torch's split weight gradients (``stage_backward_weight``, torch
      2.13) differentiate with respect to the stage's sharded parameters, not the gathered ones FSDP
      computes with, so the weight gradients would be lost (measured: the norms differ from step 0).

    The scripts refuse the same flags before torch loads (``tpzoo.training.parallel_config.ParallelConfig``).
    """
    if config.use_distributed_optimizer:
        raise ValueError("FSDP shards the optimizer state over dp already; turn off use_distributed_optimizer "
                         "(--use-distributed-optimizer) or FSDP (--use-torch-fsdp2)")
    if mesh.pp_size > 1 and config.schedule == "interleaved-zero-bubble":
        raise ValueError(f"FSDP cannot run the interleaved-zero-bubble schedule (pp={mesh.pp_size}): its split "
                         f"weight gradients miss FSDP's gathered weights; use interleaved-1f1b")


def fsdp_units(model: StagedModel) -> list[nn.Module]:
    """The FSDP units of a stage besides its root: each layer, and the embedding and the head unless the
    head's output layer reads the embedding's weight in this stage (a tied model held whole: then the two
    stay in the root unit, gathered together for the whole forward)."""
    tied_here = (model.ties_output_to_embedding and model.config.tie_word_embeddings
                 and model.embedding is not None and model.head is not None)
    ends = [] if tied_here else [m for m in (model.embedding, model.head) if m is not None]
    return [*model.layers.values(), *ends]


class FSDPParams:
    """Shards each of ``chunks`` (``StageModule``s: the units of ``fsdp_units``, the chunk the root unit)
    over dp for a run at ``precision``; ``params``: the sharded parameters, ``owned`` those that train."""

    def __init__(self, chunks: list[nn.Module], precision: str, mesh: ParallelMesh) -> None:
        for chunk in chunks:
            apply_fsdp(chunk, fsdp_units(chunk.model), mesh, param_dtype=DTYPES[precision])
        self.chunks = chunks
        self.params = [p for c in chunks for p in c.parameters()]
        self.owned = [p for p in self.params if p.requires_grad]  # a frozen parameter (LoRA's base) is not stepped

    def main_of(self, p: nn.Parameter) -> nn.Parameter:
        return p

    def flush(self) -> None:
        """Nothing: FSDP's post-backward leaves every gradient reduced and sharded."""

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def abandon_step(self) -> None:
        """After a forward or backward that raised: FSDP's per-step state is undefined until each root
        resets it (torch's ``FSDPModule.reset_iter_state``), so the engine can take the next step."""
        for chunk in self.chunks:
            chunk.reset_iter_state()

    def publish(self) -> None:
        """Nothing: the next forward gathers the updated shards."""

    def weights(self, model: nn.Module, loading: bool = False) -> dict[str, torch.Tensor | None]:
        """Parameter name -> its sharded weight (a DTensor over dp, detached) for every parameter of ``model``, which
        a load fills in place (``loading`` changes nothing: the shards are float32 at every precision)."""
        return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}
