"""The run configuration as typed sections: each a frozen dataclass whose fields carry their Megatron-LM flag,
default, meaning, check and metavar (``tpzoo.models.config._field``, as the model and engine configs declare theirs);
a command's flag group is generated from a section (``add_section``) and what the flags gave becomes the section
(``section_of``), which the code below the commands takes instead of the parsed flags.

    add_section(parser, StoppingConfig, "stopping")        # --exit-signal-handler/--no-..., --exit-interval ...
    stopping = section_of(StoppingConfig, vars(args))        # checked like any construction: ValueError names the field

A bool field whose default is True gets ``--flag`` and ``--no-flag``, one whose default is False a switch; any other
field takes one value read by its check's ``parse`` (``tpzoo.flag_types``: the same range, in the flag's words).
The sections so far: ``StoppingConfig``; the other flag groups are still written by hand in the ``*_args`` modules.
Imports without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from tpzoo.models.config import _bool, _field, _int, _optional, _positive_float, check_fields

S = TypeVar("S")


def add_section(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """The flag group ``title`` of section ``cls``: one flag per field that declares one."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        flag, check, meta = f.metadata.get("flag"), f.metadata.get("check"), f.metadata
        if flag is None:
            continue
        if f.default is True:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=True, help=meta["doc"])
        elif f.default is False:
            group.add_argument(flag, dest=f.name, action="store_true", help=meta["doc"])
        else:
            group.add_argument(flag, dest=f.name, type=check.parse, default=f.default, metavar=meta.get("metavar"),
                               help=meta["doc"])


def section_of(cls: type[S], values: Mapping[str, Any]) -> S:
    """Section ``cls`` of ``values`` (flags by destination, e.g. ``vars(args)``): its fields' values, the others
    its defaults."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


@dataclass(frozen=True)
class StoppingConfig:
    """When a run stops early (Megatron-LM's names; ``tpzoo.training.stopping``)."""

    exit_signal_handler: bool = _field(True, _bool, "on SIGTERM or SIGINT finish the step, save and exit 0 (a "
                                       "second Ctrl-C kills)", "--exit-signal-handler")
    exit_interval: int | None = _field(None, _optional(_int(1)), "save and exit 0 after an iteration divisible by N",
                                       "--exit-interval", "N")
    exit_duration_in_mins: float | None = _field(None, _optional(_positive_float), "save and exit 0 once M minutes "
                                                 "have passed since training started", "--exit-duration-in-mins", "M")
    max_skipped_steps: int = _field(10, _int(1), "exit 1 after N steps in a row skipped for a non-finite loss or "
                                    "gradient norm", "--max-skipped-steps", "N")

    def __post_init__(self) -> None:
        check_fields(self)
