"""Run configuration sections: frozen dataclasses whose fields carry their Megatron-LM flag(s), default, meaning,
check and metavar (``tpzoo.fields.option``, as the model and engine configs declare theirs) and how a run
treats them (``role``). A command's flag group is generated from a section (``add_section``) and what the flags gave
becomes the section (``section_of``).

    add_section(parser, StoppingConfig, "stopping")        # --exit-signal-handler/--no-..., --exit-interval ...
    stopping = section_of(StoppingConfig, vars(args))        # checked like any construction: ValueError names the field

A bool field whose default is True gets ``--flag`` and ``--no-flag`` (a flag spelt ``--no-...`` or ``--disable-...``
alone: it turns the field off), one whose default is False a switch; any other field takes one value read by its
check's ``parse`` (``tpzoo.flag_types``: the same range, in the flag's words), among its ``choices`` where the check
has them, ``nargs`` values where the field says so; an empty meaning shows the default alone in --help.

Roles (``role(name, *sections)`` lists the fields of a role), what a resume (``tpzoo.training.resolve``) does:
``launch``: the launch's own, never restored from a checkpoint; ``meaning``: what the run trains on, a resume that
changes it says so; ``path``: a file or folder, recorded absolute; ``together``: flags a resume does not restore
once this one is given. ``exclusive``: fields sharing the name are flags of which one may be given.
Imports without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable, Mapping, TypeVar

S = TypeVar("S")


def add_section(parser: argparse.ArgumentParser, cls: type, title: str, skip: Iterable[str] = (),
                **defaults: Any) -> argparse._ArgumentGroup:
    """The flag group ``title`` of section ``cls``: one flag per field that declares one, except those of ``skip``;
    ``defaults`` replace the fields' defaults in this command (pretrain.py's batch sizes, finetune.py's lr)."""
    group, exclusive = parser.add_argument_group(title), {}
    for f in dataclasses.fields(cls):
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
        if default is True and names[0].startswith(("--no-", "--disable-")):
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
    """The fields of ``sections`` that have role ``name``, by flag destination -> the role's value."""
    return {f.name: f.metadata[name] for cls in sections for f in dataclasses.fields(cls) if f.metadata.get(name)}
