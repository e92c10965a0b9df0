"""The flags ``pretrain.py`` and ``finetune.py`` share (Megatron-LM's names, ``shared/CONTRACT.md``
section 1), and what they turn into: the model config (what the model is) and the ``EngineConfig``; the mesh,
precision and stopping flags are generated from their run configuration sections (``tpzoo.training.parallel_config``,
``tpzoo.training.run_config``).

    parser = command_parser("pretrain.py", "Pretrain a model on the pp x dp x tp mesh.")
    add_model_args(parser); add_parallel_args(parser); add_precision_args(parser)
    add_optimizer_args(parser)                        # tpzoo.training.optimizer_args: batch, schedule, optimizer
    args = parser.parse_args()
    config = model_config(args)                       # the preset, overridden by the model flags given
    job = RunConfig.of(vars(args))                    # the sections: job.engine(), job.plan(mesh) ...

``--model`` names a family of ``tpzoo.models.families`` and ``--preset`` any family's preset. Flags a
script does not want to default are None until given; ``model_config`` applies only those given.
This module imports without torch. Misuse leaves through ``exit_on_misuse``: one line on stderr,
exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from tpzoo.flag_types import positive_int
from tpzoo.models.config import ModelConfig, field_names
from tpzoo.models.families import FAMILIES, PRESETS, family
from tpzoo.models.family_flag import add_model_flag
from tpzoo.models.presets import get_preset
from tpzoo.training.checkpoint_args import RunIO
from tpzoo.training.parallel_config import ParallelConfig, PrecisionConfig
from tpzoo.training.run_config import StoppingConfig, add_section

MISUSE = (ValueError, TypeError, FileNotFoundError, KeyError)


class DefaultsOnceFormatter(argparse.HelpFormatter):
    """Help that states each flag's default once: appended as ``(default: X)`` unless the help text
    already says it; nothing for defaults that mean "not given" (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit status 2, and whose
    --help gives every flag's default once."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def format_help(self) -> str:
        for action in self._actions:  # argparse prints no help line at all for a flag without help text
            if action.help is None and action.default not in (None, False, argparse.SUPPRESS):
                action.help = "default: %(default)s"
        return super().format_help()

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        """argparse's, with ``--config FILE`` (where the parser has it) replaced by the file's flags, put first."""
        if "config" in {a.dest for a in self._actions}:
            from tpzoo.training.config_file import expand_config

            try:
                args = expand_config(self, list(sys.argv[1:] if args is None else args))
            except ValueError as e:
                self.error(str(e))
        return super().parse_known_args(args, namespace)

    def given(self, argv: list[str] | None = None) -> set[str]:
        """The destinations of the flags written on the command line (``argv``, default sys.argv),
        as opposed to those left at their defaults."""
        return set(vars(self.parse_args(argv, Unfilled())))


class Unfilled(argparse.Namespace):
    """A namespace that claims to hold every attribute, so argparse fills in no defaults and only the
    flags actually given land in it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return None


def command_parser(prog: str, description: str) -> CommandParser:
    return CommandParser(prog=prog, description=description, formatter_class=DefaultsOnceFormatter)


def exit_on_misuse(prog: str, main: Callable[[], Any]) -> Any:
    """Run ``main``; a ValueError/TypeError/FileNotFoundError/KeyError (bad input) becomes
    ``prog: error: <message>`` on stderr and exit status 2, without a traceback."""
    try:
        return main()
    except MISUSE as err:
        _exit(prog, " ".join(str(err.args[0] if isinstance(err, KeyError) and err.args else err).split()), 2)


def exit_on_run_error(prog: str, main: Callable[[], Any]) -> Any:
    """Run ``main`` (the training loop); what stops it for a reason the user can fix becomes ``prog: error:
    <message>`` on rank 0's stderr, on every rank: a checkpoint that cannot be written (``CheckpointWriteError``:
    disk full, no permission; exit status 1, latest unchanged), or a sharding plan that misdescribes a
    parameter, found on the first step before any update (``PlanError``; exit status 2)."""
    from tpzoo.checkpoint.save import CheckpointWriteError  # torch: imported once the flags are checked
    from tpzoo.engine.replicas import PlanError

    try:
        return main()
    except CheckpointWriteError as err:
        _exit(prog, str(err), 1)
    except PlanError as err:
        _exit(prog, str(err), 2)


def _exit(prog: str, message: str, status: int) -> NoReturn:
    """``prog: error: <message>`` on stderr (rank 0 only: under torchrun every rank fails alike, one line
    is enough) and exit ``status``, without a traceback."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(status) from None


def check_output_folder(flag: str, path: str | os.PathLike | None) -> None:
    """ValueError naming ``flag`` when the folder ``path`` cannot be made because it, or a folder
    above it, is a file (checked before anything heavy runs; None = not given)."""
    if path is None:
        return
    for p in (Path(path), *Path(path).absolute().parents):
        try:
            exists, is_dir = p.exists(), p.is_dir()
        except OSError as e:  # a folder above it that may not be read
            raise ValueError(f"{flag} {path}: cannot look at {p} ({e.strerror or e}); choose another path") from None
        if exists:
            if not is_dir:
                where = "" if p == Path(path) else f": {p}"
                raise ValueError(f"{flag} {path}{where} is a file, not a folder; choose another path")
            return


def check_preset(args: argparse.Namespace) -> None:
    """ValueError unless ``--preset`` (if given) is a preset of a registered family."""
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"--preset {args.preset}: unknown preset; choose one of {', '.join(PRESETS)}")


def model_flag_fields() -> dict[str, dataclasses.Field]:
    """The config fields, of every registered family's config, that a flag of their own name sets (``--num-layers``:
    ``num_layers``; ``ModelConfig.flag_fields``): the flags that override a preset's value."""
    out = dict(ModelConfig.flag_fields())
    for f in FAMILIES.values():
        out.update({k: v for k, v in f.config_class.flag_fields().items() if k not in out})
    return out


def config_flag(group: argparse._ArgumentGroup, name: str, help: str = "default: the preset's") -> None:
    """Add config field ``name``'s flag to ``group``: its name, value type and meaning as the field declares them
    (``tpzoo.models.config``), None until given."""
    f = model_flag_fields()[name]
    group.add_argument(f.metadata["flag"], type=f.metadata["check"].parse, help=f"{f.metadata['doc']} ({help})")


def add_model_args(parser: argparse.ArgumentParser, default_model: str = "gpt") -> None:
    """``--model --preset`` and the shape flags that override the preset (None = the preset's). ``--model``
    stays None until given: ``tpzoo.training.architecture_args.resolve_architecture`` sets it (the family
    the architecture flags describe, ``default_model`` first when several do)."""
    g = parser.add_argument_group("model")
    add_model_flag(g, metavar="FAMILY", help=f"the model family: {', '.join(FAMILIES)}, or module:NAME, a "
                   f"tpzoo.models.Family of your own (docs/new-model.md) (default: the one Megatron-LM's architecture "
                   f"flags describe, {default_model} without them)")
    parser.set_defaults(default_model=default_model)
    defaults = ", ".join(f.default_preset for f in FAMILIES.values())
    g.add_argument("--preset", metavar="NAME", help=f"model shape, a preset of the --model family: "
                   f"{', '.join(PRESETS)} (default: the family's {defaults})")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                 "max_position_embeddings", "hidden_dropout", "attention_dropout"):
        config_flag(g, name)
    g.add_argument("--seq-length", type=positive_int, default=64, help="tokens per training sequence")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """The mesh flags (``tpzoo.training.parallel_config.ParallelConfig``)."""
    add_section(parser, ParallelConfig, "parallel")


def add_precision_args(parser: argparse.ArgumentParser) -> None:
    """--bf16/--fp16, fp16's loss scale and the speed options (``tpzoo.training.parallel_config.PrecisionConfig``)."""
    add_section(parser, PrecisionConfig, "precision and speed")


def model_config(args: argparse.Namespace, base: ModelConfig | None = None, **changes: Any) -> ModelConfig:
    """``base`` (default: ``--preset``, else the ``--model`` family's default preset) with the model
    flags given and ``changes`` applied. A flag the family's config has no field for is a ValueError."""
    fam = family(args.model)
    if base is None:
        base = get_preset(args.preset or fam.default_preset)
    if base.model_type != fam.name:
        raise ValueError(f"--preset {args.preset} is a {base.model_type} model but --model is {args.model}; "
                         f"drop one of them or make them agree")
    given = {name: getattr(args, name) for name in model_flag_fields() if getattr(args, name, None) is not None}
    foreign = [name for name in given if name not in field_names(type(base))]
    if foreign:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in foreign)
        raise ValueError(f"{flags} does not apply to --model {base.model_type} (its {type(base).__name__} has no "
                         f"{', '.join(foreign)}); drop it")
    config = base.replace(**given, **changes)
    if args.seq_length > config.max_position_embeddings:
        raise ValueError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                         f"{config.max_position_embeddings}; lower the first or raise the second")
    return config


def add_run_args(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Checkpointing, evaluation and logging: ``--save --save-interval --load --eval-interval
    --eval-iters --log-interval --log-dir`` (``tpzoo.training.checkpoint_args.RunIO``; ``defaults``
    override its defaults), and the stopping flags (``add_stopping_args``)."""
    add_section(parser, RunIO, "run", **defaults)
    add_stopping_args(parser)


def add_stopping_args(parser: argparse.ArgumentParser) -> None:
    """When a run stops early: the flags of ``tpzoo.training.run_config.StoppingConfig``."""
    add_section(parser, StoppingConfig, "stopping")
