"""``ShardingPlan``: how tensor parallelism splits a model, as data that lives next to the model.

A plan maps module-path patterns to styles; ``tpzoo.parallel.parallelize`` applies it. A pattern is
a dotted path whose ``*`` components match any one name (``layers.*.mlp.dense_h_to_4h``); it
names a module, or for the two parameter styles (``partial``, ``replicated``) also a parameter.
At most one pattern may match a path. The styles (what each does: ``tpzoo.parallel.styles``):

    column        nn.Linear, Y = X A: rows of A split over tp; output [..., out/tp]
    grouped_qkv   column, rows in whole query groups (attention's fused QKV; tp divides the groups)
    row           nn.Linear, Y = sum_r X_r A_r: columns of A split; input [..., in/tp], output summed
    experts       a mixture of experts' expert MLPs, each split as column and row; their weighted sum all-reduced
    vocab         nn.Embedding / nn.Linear / a module of [V] vectors: rows of the padded vocabulary split
    vocab_output  the logits-and-loss module of an LM head: vocab-parallel logits and cross entropy
    norm          a norm on the residual stream: replicated (a partial gradient under sequence parallelism)
    heads         a module computing on this rank's heads: dropout from the tp stream, gradients partial
    partial       replicated weights acting on activations split over tp: gradients summed over tp
    replicated    replicated weights acting on replicated activations: gradients kept as they are
    scatter       replicated; under sequence parallelism its output is cut to this rank's sequence slice
    gather        under sequence parallelism its input is gathered: it and all below it see whole sequences

The sequence-parallel region is a matter of paths: ``gather`` takes its module and all below it out,
and nothing else. A module that runs after a gathered one and so sees whole sequences too (a pooler
beside a gathered head's first layer, say) is a sibling, still inside by path: style it
``replicated``, or a parameter there would be taken for a partial sum (the engine's first-step check
of replicated gradients stops such a run, naming the parameter).

``tp_divides`` names the config sizes tensor parallelism splits (``ModelConfig.size``): they are
checked against tp before anything is built, with the size's name in the error.

This module imports nothing heavy: a model file states its plan without importing ``tpzoo.parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

STYLES = ("column", "grouped_qkv", "row", "experts", "vocab", "vocab_output", "norm", "heads", "partial",
          "replicated", "scatter", "gather")
PARAMETER_STYLES = ("partial", "replicated")  # the styles a pattern may give a parameter


def matches(pattern: str, path: str) -> bool:
    """Whether dotted ``path`` matches ``pattern`` (``*`` = any one component)."""
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have))


def prefixed(prefix: str, styles: Mapping[str, str]) -> dict[str, str]:
    """``styles`` with every pattern put under ``prefix`` (a block's plan inside a model)."""
    return {f"{prefix}.{pattern}": style for pattern, style in styles.items()}


@dataclass(frozen=True)
class ShardingPlan:
    """Module-path patterns -> styles, and the config sizes tp must divide (see module docstring)."""

    styles: Mapping[str, str]
    tp_divides: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for pattern, style in self.styles.items():
            if style not in STYLES:
                raise ValueError(f"sharding plan: {pattern!r} has style {style!r}; the styles are {', '.join(STYLES)}")
            if not pattern or any(not part for part in pattern.split(".")):
                raise ValueError(f"sharding plan: {pattern!r} is not a dotted module path")

    def style_of(self, path: str) -> str | None:
        """The style of the module or parameter at ``path``, or None when no pattern matches it."""
        found = [(pattern, style) for pattern, style in self.styles.items() if matches(pattern, path)]
        if len(found) > 1:
            raise ValueError(f"sharding plan: {path} matches {len(found)} patterns ({', '.join(p for p, _ in found)}); "
                             f"keep one")
        return found[0][1] if found else None

    def __or__(self, other: ShardingPlan) -> ShardingPlan:
        """Both plans' patterns (``other``'s win where the same pattern is in both) and sizes."""
        return ShardingPlan({**self.styles, **other.styles}, tuple(dict.fromkeys(self.tp_divides + other.tp_divides)))
