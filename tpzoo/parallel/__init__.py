"""Tensor-parallel building blocks on a ``pp x dp x tp`` mesh (see ``mesh`` for the layout), and
``parallelize``, which applies a model's ``ShardingPlan`` and a ``ParallelPlan`` to its plain code."""

from tpzoo.parallel.collectives import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from tpzoo.parallel.cross_entropy import vocab_parallel_cross_entropy
from tpzoo.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    padded_vocab_size,
    scaled_init_method_normal,
    sync_sequence_parallel_grads,
)
from tpzoo.parallel.mesh import ParallelMesh, get_mesh, init_mesh, mesh_shape
from tpzoo.parallel.parallelize import parallelize
from tpzoo.parallel.param_facts import ParamFacts, facts, mark
from tpzoo.parallel.plan import ParallelPlan, as_plan
from tpzoo.parallel.random import RNGStatesTracker, manual_seed
from tpzoo.sharding_plan import ShardingPlan

__all__ = [
    "ColumnParallelLinear", "ParallelMesh", "ParallelPlan", "ParamFacts", "facts", "mark", "RNGStatesTracker", "RowParallelLinear",
    "ShardingPlan", "VocabParallelEmbedding", "as_plan", "parallelize", "copy_to_tp_region",
    "gather_from_sequence_parallel_region", "gather_from_tp_region", "get_mesh",
    "init_method_normal", "init_mesh", "manual_seed", "mesh_shape", "padded_vocab_size", "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region", "scaled_init_method_normal", "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region", "sync_sequence_parallel_grads", "vocab_parallel_cross_entropy",
]
