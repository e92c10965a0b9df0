"""The run configuration as typed sections: each a frozen dataclass whose fields carry their Megatron-LM flag(s),
default, meaning, check and metavar (``tpzoo.models.config._field``, as the model and engine configs declare theirs)
and how a run treats them (``role``); a command's flag group is generated from a section (``add_section``) and
what the flags gave becomes the section (``section_of``), which the code below the commands takes instead of the
parsed flags.

    add_section(parser, StoppingConfig, "stopping")        # --exit-signal-handler/--no-..., --exit-interval ...
    stopping = section_of(StoppingConfig, vars(args))        # checked like any construction: ValueError names the field

A bool field whose default is True gets ``--flag`` and ``--no-flag`` (a flag spelt ``--no-...`` or ``--disable-...``
alone: it turns the field off), one whose default is False a switch; any other field takes one value read by its
check's ``parse`` (``tpzoo.flag_types``: the same range, in the flag's words), among its ``choices`` where the check
has them, ``nargs`` values where the field says so.

Roles (``role(name, *sections)`` lists the fields of a role), what a resume (``tpzoo.training.setup``) does:
``launch``: the launch's own, never restored from a checkpoint; ``meaning``: what the run trains on, a resume that
changes it says so; ``path``: a file or folder, recorded absolute; ``together``: flags a resume does not restore
once this one is given. ``exclusive``: fields sharing the name are flags of which one may be given. Imports without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Mapping, TypeVar

from tpzoo.models.config import _bool, _field, _int, _optional, _positive_float, check_fields

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


@dataclass(frozen=True)
class StoppingConfig:
    """When a run stops early (Megatron-LM's names; ``tpzoo.training.stopping``)."""

    exit_signal_handler: bool = _field(True, _bool, "on SIGTERM or SIGINT finish the step, save and exit 0 (a "
                                       "second Ctrl-C kills)", "--exit-signal-handler", launch=True)
    exit_interval: int | None = _field(None, _optional(_int(1)), "save and exit 0 after an iteration divisible by N",
                                       "--exit-interval", "N", launch=True)
    exit_duration_in_mins: float | None = _field(None, _optional(_positive_float), "save and exit 0 once M minutes "
                                                 "have passed since training started", "--exit-duration-in-mins", "M",
                                                 launch=True)
    max_skipped_steps: int = _field(10, _int(1), "exit 1 after N steps in a row skipped for a non-finite loss or "
                                    "gradient norm", "--max-skipped-steps", "N", launch=True)

    def __post_init__(self) -> None:
        check_fields(self)


def _sections() -> dict[str, type]:
    from tpzoo.training.checkpoint_args import CheckpointConfig, RunIO
    from tpzoo.training.logging_args import LoggingConfig
    from tpzoo.training.parallel_config import ParallelConfig, PrecisionConfig, SpeedConfig

    return dict(parallel=ParallelConfig, precision=PrecisionConfig, speed=SpeedConfig, io=RunIO,
                checkpoint=CheckpointConfig, logging=LoggingConfig, stopping=StoppingConfig)


@dataclass(frozen=True)
class RunConfig:
    """A run's resolved configuration: its typed sections (``SECTIONS``), made once from the resolved flags, and
    those flags by destination (read-only: what a checkpoint and config.toml record)."""

    flags: Mapping[str, Any]
    parallel: Any
    precision: Any
    speed: Any
    io: Any
    checkpoint: Any
    logging: Any
    stopping: StoppingConfig

    @classmethod
    def of(cls, flags: Mapping[str, Any]) -> RunConfig:
        """The sections of ``flags`` (a command's resolved flags by destination); ValueError naming the field or
        flag a section refuses."""
        flags = MappingProxyType(dict(flags))
        return cls(flags, **{name: section_of(section, flags) for name, section in SECTIONS.items()})

    def plan(self, mesh: Any) -> Any:
        """The ``tpzoo.parallel.ParallelPlan`` of ``mesh`` (a ``ParallelMesh``) and the sections
        (``tpzoo.training.parallel_config.plan_of``; the weights' seed: ``--seed``)."""
        from tpzoo.training.parallel_config import plan_of

        return plan_of(self.parallel, self.precision, self.speed, self.flags["seed"], mesh)


SECTIONS = _sections()  # name -> section class, in the order of RunConfig's fields
