"""Config fields that declare, next to each value, its check, its meaning and the Megatron-LM flag that sets it:
what the model, engine and run configurations are made of (``option``), and the checks they run when made
(``check_fields``: a ValueError naming the class, the field and the value). A check returns what is wrong with a
value, or None; it carries the ``tpzoo.flag_types`` function that reads its flag (``parse``) and, for a choice, its
``choices``, so that a flag generated from the field (``tpzoo.training.sections``) refuses what the field refuses,
in the flag's words. Imports without torch.

    lr: float = option(1e-3, positive_number, "the peak learning rate", "--lr")
    exit_interval: int | None = option(None, optional(at_least(1)), "save and exit ...", "--exit-interval", "N")
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from tpzoo import flag_types

Check = Callable[[Any], str | None]  # returns what is wrong with the value, or None


def parses(parse: Callable[[str], Any]) -> Callable[[Check], Check]:
    """Give a check the ``tpzoo.flag_types`` function that reads its field's command-line flag (``parse``)."""
    def attach(check: Check) -> Check:
        check.parse = parse
        return check
    return attach


def at_least(minimum: int) -> Check:
    @parses(flag_types.positive_int if minimum >= 1 else flag_types.non_negative_int)
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"must be an int, got {type(v).__name__} {v!r}"
        return None if v >= minimum else f"must be >= {minimum}, got {v}"
    return check


def optional(inner: Check) -> Check:
    """``inner``, or None; the same flag (its ``parse`` and ``choices``)."""
    check = lambda v: None if v is None else inner(v)  # noqa: E731
    check.__dict__.update(vars(inner))
    return check


@parses(str)
def string(v: Any) -> str | None:
    return None if isinstance(v, str) else f"must be a str, got {type(v).__name__} {v!r}"


@parses(flag_types.probability)
def fraction(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"must be a float in [0, 1), got {type(v).__name__} {v!r}"
    return None if 0.0 <= v < 1.0 else f"must lie in [0, 1), got {v}"


@parses(flag_types.positive_float)
def positive_number(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return f"must be a finite float, got {type(v).__name__} {v!r}"
    return None if v > 0 else f"must be > 0, got {v}"


@parses(flag_types.non_negative_float)
def non_negative_number(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return f"must be a finite float, got {type(v).__name__} {v!r}"
    return None if v >= 0 else f"must be >= 0, got {v}"


def boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"must be True or False, got {type(v).__name__} {v!r}"


def one_of(*options: Any) -> Check:
    """One of ``options``; its flag takes them as ``choices`` (read as their type: ints for ints)."""
    shown = ", ".join(repr(o) for o in options)
    check = parses(type(options[0]))(lambda v: None if v in options else f"must be one of {shown}, got {v!r}")
    check.choices = options
    return check


def option(default: Any, check: Check | None, doc: str, flag: str | tuple[str, ...] | None = None,
           metavar: str | tuple[str, ...] | None = None, **role: Any) -> Any:
    """A config field: its default, its check, its meaning and the Megatron-LM flag that sets it (if any; a tuple:
    the flag and its aliases; ``metavar``: what its value is called in --help). ``role``: how a run configuration
    treats the field (``tpzoo.training.run_config``: ``launch``, ``meaning``, ``path``, ``together``, ``nargs``)."""
    return dataclasses.field(default=default, metadata={"check": check, "doc": doc, "flag": flag, "metavar": metavar, **role})


def check_fields(config: Any) -> None:
    """ValueError naming the first field of the dataclass ``config`` whose check fails (a field without one passes)."""
    for f in dataclasses.fields(config):
        problem = (f.metadata.get("check") or (lambda v: None))(getattr(config, f.name))
        if problem:
            raise ValueError(f"{type(config).__name__}.{f.name} {problem}")
