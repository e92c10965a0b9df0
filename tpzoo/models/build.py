"""``build_model``: a plain model class and a ``ParallelPlan`` -> this rank's model or pipeline stage, the
one builder that the engine, scripts, checkpoints and conversion use.

    model = build_model("LlamaModel", get_preset("llama-tiny"), plan)       # a class name, or the class
    stage = build_model(LlamaModel, config, plan, pre_process=False, layers=range(2, 4))
    engine = Engine(functools.partial(build_model, MyModel, config), config, EngineConfig(...), plan)

The model class is plain PyTorch; its ``sharding`` plan says how tensor parallelism splits it. Here:

1. the sizes the plan splits (``ShardingPlan.tp_divides``) are checked against tp, naming them;
2. each piece is built under its seed (``plan.seed``) and at once handed to
   ``tpzoo.parallel.parallelize`` with the plan: sharded, its parameters' facts set, moved to the
   device, so a rank holds at most one piece's full weights;
3. the pipeline facts: the word embedding of a first stage and its copy in a last stage's head,
   when the head reads it, are ``pp_tied`` (the engine sums their gradients);
4. the plan's layer recompute (``LayerRecompute``) runs the layers; ``plan.compile`` compiles them.

The built model keeps ``plan`` and ``mesh`` as attributes (what state dicts and saving read).
``ParallelAttention`` is the block library's ``Attention`` with its plan applied, for people who
build models by hand from tensor-parallel layers.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from tpzoo.models.attention import ATTENTION_PLAN, Attention
from tpzoo.models.base import StagedModel
from tpzoo.models.compile import compile_model
from tpzoo.models.config import ModelConfig
from tpzoo.models.families import model_class
from tpzoo.parallel import ParallelMesh, ParallelPlan, as_plan, mark, parallelize
from tpzoo.parallel.recompute import LayerRecompute
from tpzoo.sharding_plan import ShardingPlan


def check_tp_divides(sharding: ShardingPlan, config: ModelConfig, tp: int) -> None:
    """ValueError naming the first size of ``sharding.tp_divides`` that tp does not divide."""
    for name in sharding.tp_divides:
        n = config.size(name)
        if n % tp:
            raise ValueError(f"{name}={n} is not divisible by the tensor-parallel size tp={tp}: tp ranks split "
                             f"them; choose tp dividing {n}")


def check_cp(config: ModelConfig, plan: ParallelPlan) -> None:
    """ValueError unless the plan's context parallelism fits the model: a2a scatters each tp rank's heads over cp."""
    tp, cp, n = plan.tp_size, plan.mesh.cp_size, config.num_attention_heads
    if cp > 1 and plan.cp_comm_type == "a2a" and n % (tp * cp):
        raise ValueError(f"--cp-comm-type a2a splits the heads over tp x cp = {tp} x {cp} = {tp * cp} ranks, but "
                         f"num_attention_heads={n} is not divisible by {tp * cp}; use --cp-comm-type p2p (ring "
                         f"attention) or a cp dividing {n // tp if n % tp == 0 else n}")


def build_model(model: str | type[StagedModel], config: ModelConfig, plan: ParallelPlan | ParallelMesh | None = None,
                **options: Any) -> StagedModel:
    """``cls(config, **options)`` with ``plan`` applied (see module docstring); ``cls`` is ``model`` or, for a
    name, that model class of the config's family. ``options``: the class's constructor options and, for
    one pipeline stage, ``pre_process``, ``post_process`` and ``layers``. ``plan``: a ``ParallelPlan``, a
    bare mesh (default run options) or None (``get_mesh()``).

    An engine's builder is ``functools.partial(build_model, cls, config, **options)``: the engine calls it
    as ``build(plan, pre_process=..., post_process=..., layers=...)``.
    """
    cls = model_class(model, config.model_type) if isinstance(model, str) else model
    if not (isinstance(cls, type) and issubclass(cls, StagedModel)):
        raise TypeError(f"model must be a model class name or a StagedModel subclass, got {model!r}")
    plan = as_plan(plan)
    cls.check_config(config)
    check_tp_divides(cls.sharding, config, plan.tp_size)
    check_cp(config, plan)
    place = partial(_place, plan=plan, sharding=cls.sharding, vocab_multiple=config.make_vocab_size_divisible_by)
    built = cls(config, seed=plan.seed, place=place, **options)
    if built.holds_tied_copy:  # the first stage's weight and this copy of it: their gradients are summed
        mark(built.head.word_embeddings.weight, pp_tied=True)
    elif built.tied_weight() is not None and not built.post_process:
        mark(built.tied_weight(), pp_tied=True)
    if plan.recompute_activations or plan.recompute_granularity == "full":
        built.layer_runner = LayerRecompute(plan)
    built.plan, built.mesh = plan, plan.mesh
    if plan.compile:
        compile_model(built)
    return built


def _place(path: str, module: nn.Module, plan: ParallelPlan, sharding: ShardingPlan, vocab_multiple: int) -> nn.Module:
    return parallelize(module, plan, sharding, prefix=path, vocab_multiple=vocab_multiple)


def ParallelAttention(hidden_size: int, num_attention_heads: int, plan: ParallelPlan | ParallelMesh | None = None,
                      **options: Any) -> nn.Module:  # noqa: N802 - a layer, named as one
    """``Attention(hidden_size, num_attention_heads, **options)`` split over ``plan``'s tp ranks by its plan
    (``ATTENTION_PLAN``): the fused QKV column-parallel in whole query groups, this rank's heads, the output
    projection row-parallel. [b, s, h] -> [b, s, h] (with sequence parallelism [b, s/tp, h] both)."""
    return parallelize(Attention(hidden_size, num_attention_heads, **options), plan, ShardingPlan(ATTENTION_PLAN))
