"""What gradient norms, checkpoints, conversion and the pipeline must know about a parameter, attached
by one function (``mark``) where the parameter is made and read by one (``facts``) wherever needed.

    tp_split_dim   a tp shard: the full tensor is the shards concatenated along this dim (None: replicated)
    tp_full_size   the full size along that dim when the shards hold padding (the vocabulary: V, not V')
    tp_partial     replicated over tp, but each rank's gradient is a partial sum (a norm or row-parallel
                   bias acting on a sequence shard under sequence parallelism): summed over tp after backward
    pp_tied        one of two copies of a weight held by two pipeline stages (the word embedding and the
                   last stage's tied output layer): their gradients are summed, the copy counted once
    ep_split       a mixture of experts' stacked expert weights [N/ep, ...], this ep rank's experts of the N
                   (``tpzoo.parallel.experts``): the full tensor is the ep group's concatenated along dim 0;
                   summed over the expert-data-parallel group, counted on every ep rank

The tensor-parallel layers mark their shards; ``tpzoo.parallel.parallelize`` marks every other parameter
from the model's sharding plan (and ``tpzoo.models.build_model`` the pipeline's tied copies), so a model
author never tags anything.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from torch import nn

_ATTRIBUTE = "_tpzoo_facts"


@dataclass(frozen=True)
class ParamFacts:
    tp_split_dim: int | None = None
    tp_full_size: int | None = None
    tp_partial: bool = False
    pp_tied: bool = False
    ep_split: bool = False


def facts(param: nn.Parameter) -> ParamFacts:
    """The facts ``mark`` attached to ``param`` (a plain replicated parameter when none)."""
    return getattr(param, _ATTRIBUTE, ParamFacts())


def mark(param: nn.Parameter, **changes: object) -> nn.Parameter:
    """Attach ``changes`` (fields of ``ParamFacts``) to ``param``'s facts; returns ``param``."""
    unknown = sorted(set(changes) - {f.name for f in fields(ParamFacts)})
    if unknown:
        raise TypeError(f"unknown parameter facts {unknown}; known: {[f.name for f in fields(ParamFacts)]}")
    setattr(param, _ATTRIBUTE, replace(facts(param), **changes))
    return param
