"""``parallelize``: a plain single-device module made this rank's part of a tensor-parallel one, by a
``ShardingPlan`` (data next to the model) and a ``ParallelPlan`` (the mesh and the run options).

    model = parallelize(GPTModel(config), ParallelPlan(mesh, sequence_parallel=True), GPTModel.sharding)

In order:

1. each module or parameter a pattern matches gets its style (``tpzoo.parallel.styles``): sharded
   linear and embedding layers, hooks at the sequence-parallel region's edges, the tp stream for
   modules computing on this rank's heads;
2. every other parameter is replicated, and its gradient taken as a partial sum over tp exactly
   when it lies in the sequence-parallel region (sequence parallelism on, no ``gather`` above it): there
   every activation a replicated weight meets is split over tp (sequence shards, or heads and features
   inside the split linears), so a LayerScale vector an author adds trains right with no plan entry;
   the engine checks every replicated gradient across tp on the first step (``tpzoo.engine.replicas``),
   so a parameter used on split activations outside that region is refused, never silently wrong;
3. dropout modules in the sequence region draw from the tp stream (sequence parallelism only);
4. the run options: torch's LayerNorm, RMSNorm and GELU become ``tpzoo.kernels``' (the same
   parameters), and a module's ``kernels`` and ``attention_backend`` attributes take the plan's;
5. the module moves to the mesh's device.

``prefix`` is the module's path inside the model (a pipeline piece: "embedding", "layers.3", "head"),
so that the patterns match whole-model paths. ``vocab_multiple``: the vocabulary is padded to a
multiple of it x tp (Megatron-LM's make-vocab-size-divisible-by). Returns what stands at the root (a
style may replace the module itself); parameters' facts (``param_facts``) are all set.
"""

from __future__ import annotations

from torch import nn

from tpzoo.kernels.modules import from_torch
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
    root, styled, gathered = module, [], []
    for path, sub in list(module.named_modules(prefix=prefix)):
        style = sharding.style_of(path) if path else None
        if style is None:
            continue
        outer = [p for p, s in styled if s != "gather" and _within(path, [p])]
        if outer:
            raise ValueError(f"sharding plan: {path} lies inside {outer[0]}, which its style already covers; drop "
                             f"one of the two patterns")
        parent = module.get_submodule(_relative(path, prefix).rpartition(".")[0]) if path != prefix else None
        sequence = plan.sequence_parallel and not _within(path, gathered)
        site = Site(path, parent, plan, sequence, vocab_multiple)
        root = _put(root, prefix, path, STYLE_FUNCTIONS[style](sub, site))
        styled.append((path, style))
        if style in ("gather", "replicated"):
            gathered.append(path)
    covered = [p for p, s in styled if s not in ("gather",)]
    for name, p in root.named_parameters(prefix=prefix, remove_duplicate=False):
        style = sharding.style_of(name)
        if style is not None and style not in PARAMETER_STYLES:
            raise ValueError(f"sharding plan: parameter {name} has style {style!r}; a parameter takes "
                             f"{' or '.join(PARAMETER_STYLES)} (give the style to its module)")
        owner = name.rpartition(".")[0]
        if style is not None and _within(owner, covered):
            raise ValueError(f"sharding plan: {name} lies inside {next(c for c in covered if _within(owner, [c]))}, "
                             f"which its style already covers; drop one of the two patterns")
        if style is not None:
            mark(p, tp_partial=style == "partial")
        elif not _within(owner, covered) and facts(p) == ParamFacts():
            mark(p, tp_partial=plan.sequence_parallel and not _within(name, gathered))
    root = _run_options(root, prefix, plan, gathered)
    return root.to(plan.mesh.device)


def _run_options(root: nn.Module, prefix: str, plan: ParallelPlan, gathered: list[str]) -> nn.Module:
    """Steps 3 and 4 of the module docstring."""
    backend = resolve_attention_backend(plan.attention_backend)
    for path, sub in list(root.named_modules(prefix=prefix)):
        if isinstance(sub, nn.Dropout) and sub.p > 0 and plan.sequence_parallel and not _within(path, gathered):
            root = _put(root, prefix, path, TPRandom(sub, plan.mesh.rng))
            continue
        kernel = from_torch(sub, plan.kernels)
        if kernel is not None:
            root = _put(root, prefix, path, kernel)
        if hasattr(sub, "kernels"):
            sub.kernels = plan.kernels
        if hasattr(sub, "attention_backend"):
            sub.attention_backend = backend
    return root
