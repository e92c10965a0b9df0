"""``parallelize``: a plain single-device module made this rank's part of a tensor-parallel one, by a
``ShardingPlan`` (data next to the model) and a ``ParallelPlan`` (the mesh and the run options).

    attention = parallelize(Attention(h, n), plan, ShardingPlan(ATTENTION_PLAN))   # one block
    model = tpzoo.models.build_model(GPTModel, config, plan)   # a whole model: piece by piece, through here

In order:

1. the run options: torch's LayerNorm, RMSNorm and GELU become ``tpzoo.kernels``' (the same
   parameters), and a module's ``kernels`` and ``attention_backend`` attributes take the plan's, its
   ``context_parallel`` the attention over the cp ranks (``context_attention``; None at cp 1);
2. each module a pattern matches gets its style (``tpzoo.parallel.styles``): sharded linear and
   embedding layers, hooks at the sequence-parallel region's edges, the tp stream for modules
   computing on this rank's heads;
3. every other parameter is replicated, and its gradient taken as a partial sum over tp exactly
   when it lies in the sequence-parallel region (sequence parallelism on, no ``gather`` or
   ``replicated`` above it): there every activation a replicated weight meets is split over tp
   (sequence shards, or heads and features inside the split linears), so a LayerScale vector an
   author adds trains right with no plan entry; the engine checks every replicated gradient across
   tp on the first step (``tpzoo.engine.replicas``), so a parameter used on split activations
   outside that region is refused, never silently wrong;
4. dropout on split activations draws from the tp stream: inside a ``heads`` module, and under
   sequence parallelism anywhere in the region;
5. the module moves to the mesh's device.

``prefix`` is the module's path inside the model (a pipeline piece: "embedding", "layers.3", "head"),
so that the patterns match whole-model paths. ``vocab_multiple``: the vocabulary is padded to a
multiple of it x tp (Megatron-LM's make-vocab-size-divisible-by). Returns what stands at the root (a
style may replace the module itself); parameters' facts (``param_facts``) are all set. A whole model
goes through ``tpzoo.models.build_model``, which also checks the plan's sizes, draws each piece's
weights under its seed, marks the pipeline's tied copies and applies recompute and compile.

Why not torch's ``parallelize_module`` (DTensor's Colwise/RowwiseParallel by path), which this
resembles: its styles turn parameters into DTensors, while tpzoo's engine works on plain tensors with
facts (the pipeline's static stage shapes, the ZeRO-2 bucketed reduce-scatter, float32 main weights,
FSDP2 over dp of the tp shards, DCP checkpoints resharded by the facts), its layouts are Megatron-LM's
(a grouped fused QKV, interleaved gate/up rows, a vocabulary padded to a multiple of tp with a
vocab-parallel cross entropy and Triton kernel), and each weight is drawn whole before it is split so
that every mesh holds the same weights. The layers were there; the plan only says where they go.
"""

from __future__ import annotations

from torch import nn

from tpzoo.kernels.modules import from_torch
from tpzoo.parallel.context_attention import context_attention
from tpzoo.parallel.mesh import ParallelMesh
from tpzoo.parallel.param_facts import ParamFacts, facts, mark
from tpzoo.parallel.plan import ParallelPlan, as_plan
from tpzoo.parallel.random import TPRandom
from tpzoo.parallel.styles import STYLE_FUNCTIONS, Site
from tpzoo.run_options import resolve_attention_backend
from tpzoo.sharding_plan import PARAMETER_STYLES, ShardingPlan


def _within(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


def _relative(path: str, prefix: str) -> str:
    return path[len(prefix) + 1:] if prefix else path


def _put(root: nn.Module, prefix: str, path: str, new: nn.Module) -> nn.Module:
    """Place ``new`` at ``path`` (``prefix``-based) inside ``root``; the new root."""
    if path == prefix:
        return new
    parent, _, name = _relative(path, prefix).rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, new)
    return root


def parallelize(module: nn.Module, plan: ParallelPlan | ParallelMesh | None, sharding: ShardingPlan, *,
                prefix: str = "", vocab_multiple: int = 128) -> nn.Module:
    """``module`` sharded over ``plan``'s tp group by ``sharding`` and given the plan's run options (see
    the module docstring); in place where it can be, the new root returned."""
    plan = as_plan(plan)
    root = _kernels(module, prefix, plan)
    root, styled = _styles(root, prefix, plan, sharding, vocab_multiple)
    _facts(root, prefix, plan, sharding, styled)
    root = _tp_random(root, prefix, plan, styled)
    return root.to(plan.mesh.device)


def _kernels(root: nn.Module, prefix: str, plan: ParallelPlan) -> nn.Module:
    """Step 1: torch's LayerNorm, RMSNorm and GELU become tpzoo.kernels' (the same parameters); ``kernels``,
    ``attention_backend``, ``grouped_gemm`` and ``context_parallel`` attributes take the plan's."""
    backend = resolve_attention_backend(plan.attention_backend)
    mesh = plan.mesh
    across = context_attention(mesh.cp_group, plan.cp_comm_type) if mesh.cp_size > 1 else None
    for path, sub in list(root.named_modules(prefix=prefix)):
        kernel = from_torch(sub, plan.kernels)
        if kernel is not None:
            root = _put(root, prefix, path, kernel)
        if hasattr(sub, "kernels"):
            sub.kernels = plan.kernels
        if hasattr(sub, "attention_backend"):
            sub.attention_backend = backend
        if hasattr(sub, "grouped_gemm"):
            sub.grouped_gemm = plan.grouped_gemm
        if hasattr(sub, "context_parallel"):
            sub.context_parallel = across
    return root


def _out_of_region(styled: list[tuple[str, str]]) -> list[str]:
    """The paths below which nothing is sequence-split: the modules styled "gather" or "replicated"."""
    return [p for p, s in styled if s in ("gather", "replicated")]


def _styles(root: nn.Module, prefix: str, plan: ParallelPlan, sharding: ShardingPlan, vocab_multiple: int
            ) -> tuple[nn.Module, list[tuple[str, str]]]:
    """Step 2: each module a pattern matches takes its style, top down; (the new root, [(path, style)])."""
    styled: list[tuple[str, str]] = []
    for path, sub in list(root.named_modules(prefix=prefix)):
        style = sharding.style_of(path) if path else None
        if style is None:
            continue
        outer = [p for p, s in styled if s != "gather" and _within(path, [p])]
        if outer:
            raise ValueError(f"sharding plan: {path} lies inside {outer[0]}, which its style already covers; drop "
                             f"one of the two patterns")
        parent = root.get_submodule(_relative(path, prefix).rpartition(".")[0]) if path != prefix else None
        sequence = plan.sequence_parallel and not _within(path, _out_of_region(styled))
        root = _put(root, prefix, path, STYLE_FUNCTIONS[style](sub, Site(path, parent, plan, sequence, vocab_multiple)))
        styled.append((path, style))
    return root, styled


def _facts(root: nn.Module, prefix: str, plan: ParallelPlan, sharding: ShardingPlan,
           styled: list[tuple[str, str]]) -> None:
    """Step 3: a parameter a pattern names takes its style; one no style covers is a partial sum exactly in the
    sequence-parallel region."""
    covered, outside = [p for p, s in styled if s != "gather"], _out_of_region(styled)
    for name, p in root.named_parameters(prefix=prefix, remove_duplicate=False):
        style, owner = sharding.style_of(name), name.rpartition(".")[0]
        if style is not None and style not in PARAMETER_STYLES:
            raise ValueError(f"sharding plan: parameter {name} has style {style!r}; a parameter takes "
                             f"{' or '.join(PARAMETER_STYLES)} (give the style to its module)")
        if style is not None and _within(owner, covered):
            raise ValueError(f"sharding plan: {name} lies inside {next(c for c in covered if _within(owner, [c]))}, "
                             f"which its style already covers; drop one of the two patterns")
        if style is not None:
            mark(p, tp_partial=style == "partial")
        elif not _within(owner, covered) and facts(p) == ParamFacts():
            mark(p, tp_partial=plan.sequence_parallel and not _within(name, outside))


def _tp_random(root: nn.Module, prefix: str, plan: ParallelPlan, styled: list[tuple[str, str]]) -> nn.Module:
    """Step 4: a dropout on activations split over tp draws from the tp stream: inside a "heads" module, and
    under sequence parallelism anywhere in the sequence region (not already inside a ``TPRandom``)."""
    heads, outside = [p for p, s in styled if s == "heads"], _out_of_region(styled)
    modules = list(root.named_modules(prefix=prefix))
    drawn = [path for path, sub in modules if isinstance(sub, TPRandom)]
    for path, sub in modules:
        split = _within(path, heads) or (plan.sequence_parallel and not _within(path, outside))
        if isinstance(sub, nn.Dropout) and sub.p > 0 and split and not _within(path, drawn):
            root = _put(root, prefix, path, TPRandom(sub, plan.mesh.rng))
    return root
