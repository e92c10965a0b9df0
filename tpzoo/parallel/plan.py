"""``ParallelPlan``: how a model runs, applied to its plain code from outside by whoever builds it.

A model's config says what the model is (sizes, kinds of blocks), its sharding plan how tensor parallelism
splits it (``tpzoo.sharding_plan``); this plan says how a run runs it: on which mesh (and so which tp shard each
rank holds), whether activations between the sublayers are split along the sequence over tp, whether layers
recompute their activations in backward, which kernels and attention backend compute it (and a mixture of
experts' experts: one grouped multiply or a loop), how attention spans a sequence split over context-parallel
ranks, whether torch.compile compiles its blocks, whether FSDP shards its weights over dp
(``tpzoo.parallel.fsdp``, applied by the engine), and the seed its weights are drawn from.
``tpzoo.models.build_model`` (what the engine builds stages with) applies it with the model's sharding plan
through ``tpzoo.parallel.parallelize``; a model never chooses any of it, so the same model code runs at any tp,
with or without sequence parallelism.

    plan = ParallelPlan(init_mesh(tp=2), sequence_parallel=True)
    model = build_model(GPTModel, get_preset("gpt-tiny"), plan)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tpzoo.parallel.mesh import ParallelMesh, get_mesh
from tpzoo.run_options import ATTENTION_BACKENDS, CP_COMM_TYPES, KERNEL_BACKENDS, PLAN_OPTIONS, recompute_problem

__all__ = ["ATTENTION_BACKENDS", "KERNEL_BACKENDS", "PLAN_OPTIONS", "ParallelPlan", "as_plan"]


@dataclass(frozen=True)
class ParallelPlan:
    """The mesh and the run options of a model (see module docstring)."""

    mesh: ParallelMesh
    sequence_parallel: bool = False     # activations [b, s/tp, h] between sublayers (needs tp > 1 to matter)
    recompute_activations: bool = False  # keep each layer's input only; rerun its forward in backward
    kernels: str | None = None           # tpzoo.kernels backend: auto | triton | torch; None reads TPZOO_KERNELS
    attention_backend: str = "auto"      # core attention: fused-softmax kernels, torch sdpa, or auto (sdpa)
    seed: int = 1234                     # weights: model piece i is drawn under a seed derived from (seed, i)
    compile: bool = False                # torch.compile each transformer layer and the loss head (docs/kernels.md)
    fsdp: bool = False                   # weights, gradients, optimizer state sharded over dp (FSDP2, ZeRO-3):
                                         # applied by the Engine; a model built or loaded outside one is whole
    grouped_gemm: bool = False           # a mixture of experts' experts as one grouped multiply, not a loop
    cp_comm_type: str = "p2p"            # at cp > 1: ring attention (p2p) or all-to-all over heads (a2a)
    # Megatron-LM's recompute (``recompute_units``): "full" layers by ``recompute_method`` and
    # ``recompute_num_layers``, or "selective": core attention only; None: recompute_activations decides
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, ParallelMesh):
            raise TypeError(f"ParallelPlan.mesh must be a ParallelMesh, got {type(self.mesh).__name__}")
        for name in ("sequence_parallel", "recompute_activations", "compile", "fsdp", "grouped_gemm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ParallelPlan.{name} must be True or False, got {getattr(self, name)!r}")
        if self.kernels not in (None, *KERNEL_BACKENDS):
            raise ValueError(f"ParallelPlan.kernels must be one of None, {', '.join(KERNEL_BACKENDS)}; "
                             f"got {self.kernels!r}")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"ParallelPlan.cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}; "
                             f"got {self.cp_comm_type!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"ParallelPlan.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                             f"got {self.attention_backend!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"ParallelPlan.seed must be an int >= 0, got {self.seed!r}")
        self._check_recompute()

    def _check_recompute(self) -> None:
        problem = recompute_problem(self.recompute_activations, self.recompute_granularity, self.recompute_method,
                                    self.recompute_num_layers)
        if problem:
            raise ValueError(f"ParallelPlan: {problem}")

    def recompute_units(self, num_layers: int) -> list[tuple[int, int, bool]]:
        """How a model chunk of ``num_layers`` layers runs them: (first, end, recomputed) spans in order.

        A recomputed span keeps only its input and reruns all of its layers in backward. Full
        recompute, Megatron-LM's methods (per model chunk, i.e. per pipeline stage or virtual stage):
        uniform N: spans of N layers (the last one shorter), each recomputed as one unit; block N:
        the first N layers recomputed one by one, the others not. ``recompute_activations``: every
        layer its own unit (uniform 1). Otherwise, and for selective: every layer, none recomputed."""
        if self.recompute_activations or self.recompute_granularity == "full":
            n = self.recompute_num_layers or 1
            if self.recompute_method == "block":
                return [(i, i + 1, i < n) for i in range(num_layers)]
            return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
        return [(i, i + 1, False) for i in range(num_layers)]

    @property
    def tp_size(self) -> int:
        return self.mesh.tp_size

    def replace(self, **changes: Any) -> ParallelPlan:
        """A copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)

    def options(self) -> dict[str, Any]:
        """The run options (``PLAN_OPTIONS``) as a plain dict, e.g. to record them in a checkpoint."""
        return {name: getattr(self, name) for name in PLAN_OPTIONS}


def as_plan(plan: ParallelPlan | ParallelMesh | None, **options: Any) -> ParallelPlan:
    """A plan from a plan, a bare mesh (default run options) or None (``get_mesh()``); ``options`` override."""
    if isinstance(plan, ParallelPlan):
        return plan.replace(**options) if options else plan
    if plan is None or isinstance(plan, ParallelMesh):
        return ParallelPlan(plan if plan is not None else get_mesh(), **options)
    raise TypeError(f"expected a ParallelPlan, a ParallelMesh or None, got {type(plan).__name__}")
