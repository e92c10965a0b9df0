"""Config fields that declare, next to each value, its check, its meaning and the Megatron-LM flag that sets it:
what the model, engine and run configurations are made of (``option``), the checks they run when made
(``check_fields``: a ValueError naming the class, the field and the value), and the command-line flags generated
from them (``add_section``). A check returns what is wrong with a value, or None; it carries the
``tpzoo.flag_types`` function that reads its flag (``parse``) and, for a choice, its ``choices``, so that the flag
refuses what the field refuses, in the flag's words. Imports without torch.

    lr: float = option(1e-3, positive_number, "the peak learning rate", "--lr")
    exit_interval: int | None = option(None, optional(at_least(1)), "save and exit ...", "--exit-interval", "N")

    add_section(parser, StoppingConfig, "stopping")     # --exit-signal-handler/--no-..., --exit-interval ...
    stopping = section_of(StoppingConfig, vars(args))    # checked like any construction: ValueError names the field

A bool field whose default is True gets ``--flag`` and ``--no-flag`` (a flag spelt ``--no-...`` or ``--disable-...``
alone: it turns the field off), one whose default is False a switch; any other field takes one value read by its
check's ``parse`` (``tpzoo.flag_types``: the same range, in the flag's words), among its ``choices`` where the check
has them, ``nargs`` values where the field says so, through the field's own argparse ``action`` where it has one; a
``switch`` is None until given (its flag: True, its ``off`` flag: False); a field holding a section holds its flags
in its place. An empty meaning shows the default alone in --help.

Roles (``role(name, *sections)`` lists the fields of a role), what a resume (``tpzoo.training.resolve``) does:
``launch``: the launch's own, never restored from a checkpoint; ``meaning``: what the run trains on, a resume that
changes it says so; ``path``: a file or folder, recorded absolute; ``together``: flags a resume does not restore
once this one is given. ``exclusive``: fields sharing the name are flags of which one may be given.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, TypeVar

from tpzoo import flag_types

Check = Callable[[Any], str | None]  # returns what is wrong with the value, or None
S = TypeVar("S")


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


@parses(flag_types.seed)
def seed(v: Any) -> str | None:
    """A random seed: an int in [0, ``flag_types.MAX_SEED``]."""
    if isinstance(v, bool) or not isinstance(v, int):
        return f"must be an int, got {type(v).__name__} {v!r}"
    return None if 0 <= v <= flag_types.MAX_SEED else f"must be a seed in [0, {flag_types.MAX_SEED}] (32 bits), got {v}"


@parses(int)
def integer(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) else f"must be an int, got {type(v).__name__} {v!r}"


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
    treats the field and its flag (``role`` and ``add_section`` below: ``launch``, ``meaning``, ``path``, ``together``,
    ``nargs``, ``exclusive``, ``action``, ``switch``)."""
    meta = {"check": check, "doc": doc, "flag": flag, "metavar": metavar, **role}
    return dataclasses.field(default=default, metadata=meta)


def toggle(doc: str, flag: str, **role: Any) -> Any:
    """A switch: False unless its flag is given."""
    return option(False, boolean, doc, flag, **role)


def check_fields(config: Any) -> None:
    """ValueError naming the first field of the dataclass ``config`` whose check fails (a field without one passes)."""
    for f in dataclasses.fields(config):
        problem = (f.metadata.get("check") or (lambda v: None))(getattr(config, f.name))
        if problem:
            raise ValueError(f"{type(config).__name__}.{f.name} {problem}")


def add_section(parser: argparse.ArgumentParser, cls: type, title: str, skip: Iterable[str] = (),
                group: argparse._ArgumentGroup | None = None, **defaults: Any) -> argparse._ArgumentGroup:
    """The flag group ``title`` (or ``group``) of section ``cls``: one flag per field that declares one, except those
    of ``skip``, a nested section's in its place; ``defaults`` replace the fields' defaults in this command
    (pretrain.py's batch sizes, finetune.py's lr)."""
    group, exclusive = group or parser.add_argument_group(title), {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default):
            add_section(parser, type(f.default), title, skip, group, **defaults)
        if f.metadata.get("flag") is None or f.name in skip:
            continue
        meta, default = f.metadata, defaults.get(f.name, f.default)
        names = (meta["flag"],) if isinstance(meta["flag"], str) else meta["flag"]
        into = group
        if meta.get("exclusive"):  # one of the fields that share the name
            if meta["exclusive"] not in exclusive:
                exclusive[meta["exclusive"]] = group.add_mutually_exclusive_group()
            into = exclusive[meta["exclusive"]]
        doc = meta["doc"] or None  # none: --help shows the default alone
        if meta.get("action"):  # its own parsing (Megatron-LM's --data-path blend)
            into.add_argument(*names, dest=f.name, action=meta["action"], default=default, nargs=meta.get("nargs"),
                              metavar=meta.get("metavar"), help=doc, **meta.get("action_options", {}))
        elif meta.get("switch"):  # None until given: the flag sets True, its ``off`` flag (and meaning) False
            if meta.get("off"):
                into.add_argument(meta["off"][0], dest=f.name, action="store_false", default=None, help=meta["off"][1])
            into.add_argument(*names, dest=f.name, action="store_true", default=None, help=doc)
        elif default is True and names[0].startswith(("--no-", "--disable-")):
            into.add_argument(*names, dest=f.name, action="store_false", default=default, help=doc)
        elif default is True:
            into.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=True, help=doc)
        elif default is False:
            into.add_argument(*names, dest=f.name, action="store_true", help=doc)
        else:
            check = meta["check"]
            into.add_argument(*names, dest=f.name, type=getattr(check, "parse", None), default=default,
                              choices=getattr(check, "choices", None), nargs=meta.get("nargs"),
                              metavar=meta.get("metavar"), help=doc)
    return group


def section_of(cls: type[S], values: Mapping[str, Any]) -> S:
    """Section ``cls`` of ``values`` (flags by destination, e.g. ``vars(args)``): its fields' values, the others
    its defaults."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def role(name: str, *sections: type) -> dict[str, Any]:
    """The fields of ``sections`` (and of the sections nested in them) that have role ``name``, by flag destination
    -> the role's value."""
    out = {}
    for cls in sections:
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default):
                out.update(role(name, type(f.default)))
            elif f.metadata.get(name):
                out[f.name] = f.metadata[name]
    return out
