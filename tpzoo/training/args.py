"""What every tpzoo command's parser shares: ``CommandParser`` (one-line errors, each default stated once in
--help, ``--config FILE`` expanded, ``given``), the misuse and run-error exits, and the flag groups pretrain.py and
finetune.py share, generated from their run configuration sections (``tpzoo.training.run_config``).

    parser = command_parser("pretrain.py", "Pretrain a model on the pp x dp x tp mesh.")
    add_parallel_args(parser); add_precision_args(parser); add_run_args(parser)
    args = parser.parse_args()
    job = RunConfig.of(vars(args))                    # the sections: job.engine(), job.plan(mesh) ...

This module imports without torch. Misuse leaves through ``exit_on_misuse``: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
from collections.abc import Sequence
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from tpzoo.training.checkpoint_args import RunIO
from tpzoo.training.config_file import Unfilled, expand_config
from tpzoo.training.parallel_config import ParallelConfig, PrecisionConfig
from tpzoo.training.run_config import StoppingConfig, add_section

MISUSE = (ValueError, TypeError, FileNotFoundError, KeyError)
ITERATION = re.compile(r"iter_\d{7,}")  # a checkpoint's folder name (tpzoo.checkpoint.paths, which imports torch)


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
            try:
                args = expand_config(self, list(sys.argv[1:] if args is None else args))
            except ValueError as e:
                self.error(str(e))
        return super().parse_known_args(args, namespace)

    def add_subparsers(self, **kwargs: Any) -> Any:
        """argparse's; each subcommand's parser a CommandParser stating its defaults once too."""
        kwargs.setdefault("parser_class", lambda **options: CommandParser(formatter_class=DefaultsOnceFormatter,
                                                                          **options))
        return super().add_subparsers(**kwargs)

    def given(self, argv: list[str] | None = None) -> set[str]:
        """The destinations of the flags written on the command line (``argv``, default sys.argv),
        as opposed to those left at their defaults."""
        return set(vars(self.parse_args(argv, Unfilled())))


def command_parser(prog: str, description: str) -> CommandParser:
    return CommandParser(prog=prog, description=description, formatter_class=DefaultsOnceFormatter)


def exit_on_misuse(prog: str, main: Callable[[], Any]) -> Any:
    """Run ``main``; a ValueError/TypeError/FileNotFoundError/KeyError (bad input) becomes
    ``prog: error: <message>`` on stderr and exit status 2, without a traceback."""
    try:
        return main()
    except MISUSE as err:
        _exit(prog, " ".join(str(err.args[0] if isinstance(err, KeyError) and err.args else err).split()), 2)


# errors of writing a file that the user fixes on the machine: a full disk or quota, a read-only or forbidden folder
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})


def exit_on_run_error(prog: str, main: Callable[[], Any]) -> Any:
    """Run ``main`` (the training loop); what stops it for a reason the user can fix becomes ``prog: error:
    <message>`` on rank 0's stderr, on every rank: a peer that died or is stuck (``PeerFailure``, named by each
    surviving rank on its own stderr, in whatever phase: setup, a step, a save or a load; exit status 1), a checkpoint that cannot be written (``CheckpointWriteError``:
    disk full, no permission; exit status 1, latest unchanged), any other file that cannot be written (the logs,
    metrics.jsonl, the run's config: an OSError of ``DISK_ERRNOS``; exit status 1), or a sharding plan that
    misdescribes a parameter, found on the first step before any update (``PlanError``; exit status 2)."""
    from tpzoo.checkpoint.save import CheckpointWriteError  # torch: imported once the flags are checked
    from tpzoo.engine.replicas import PlanError
    from tpzoo.parallel.rollcall import PeerFailure

    try:
        return main()
    except PeerFailure as err:  # each surviving rank names the missing ones: rank 0 may be among them
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except CheckpointWriteError as err:
        _exit(prog, str(err), 1)
    except PlanError as err:
        _exit(prog, str(err), 2)
    except OSError as err:
        if err.errno not in DISK_ERRNOS:
            raise
        _exit(prog, f"cannot write {err.filename or 'a file of the run'}: [Errno {err.errno}] {err.strerror}; free "
                    f"space or fix the folder's permissions, or pass another --save or --log-dir", 1)


def _exit(prog: str, message: str, status: int) -> NoReturn:
    """``prog: error: <message>`` on stderr (rank 0 only: under torchrun every rank fails alike, one line
    is enough) and exit ``status``, without a traceback."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(status) from None


def check_output_folder(flag: str, path: str | os.PathLike | None) -> None:
    """ValueError naming ``flag`` when the folder ``path`` cannot be made or written: it, or a folder above it,
    is a file, or the nearest existing one is read-only or not writable (checked before anything heavy runs;
    None = not given)."""
    if path is None:
        return
    for p in (Path(path), *Path(path).absolute().parents):
        try:
            exists, is_dir = p.exists(), p.is_dir()
        except OSError as e:  # a folder above it that may not be read
            raise ValueError(f"{flag} {path}: cannot look at {p} ({e.strerror or e}); choose another path") from None
        if exists:
            where = "" if p == Path(path) else f": {p}"
            if not is_dir:
                raise ValueError(f"{flag} {path}{where} is a file, not a folder; choose another path")
            if not os.access(p, os.W_OK | os.X_OK):
                why = "is on a read-only file system" if os.statvfs(p).f_flag & os.ST_RDONLY else "is not writable"
                raise ValueError(f"{flag} {path}{where} {why}; choose a folder you can write")
            return


def check_save_folder(path: str | os.PathLike | None) -> None:
    """ValueError when the --save folder ``path`` (or the save folder of the iteration folder it names: where a
    resume saves) holds a file where a checkpoint would go (an ``iter_NNNNNNN`` or ``latest`` of the wrong kind):
    a save there would fail after training, or replace the file."""
    folder = Path(path) if path is not None else None
    if folder is not None and ITERATION.fullmatch(folder.name):
        folder = folder.parent
    if folder is None or not folder.is_dir():
        return
    for entry in folder.iterdir():
        wrong = (ITERATION.fullmatch(entry.name) and not entry.is_dir()) or (entry.name == "latest" and
                                                                            not entry.is_file())
        if wrong:
            kind = "a folder" if entry.is_dir() else "a file" if entry.is_file() else "not a plain file or folder"
            raise ValueError(f"--save {path}: {entry} is {kind}, where a checkpoint's "
                             f"{'name' if entry.name == 'latest' else 'folder'} goes; move it away or choose "
                             f"another --save")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """The mesh flags (``tpzoo.training.parallel_config.ParallelConfig``)."""
    add_section(parser, ParallelConfig, "parallel")


def add_precision_args(parser: argparse.ArgumentParser) -> None:
    """--bf16/--fp16, fp16's loss scale and the speed options (``tpzoo.training.parallel_config.PrecisionConfig``)."""
    add_section(parser, PrecisionConfig, "precision and speed")


def add_run_args(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Checkpointing, evaluation and logging: ``--save --save-interval --load --eval-interval
    --eval-iters --log-interval --log-dir`` (``tpzoo.training.checkpoint_args.RunIO``; ``defaults``
    override its defaults), and the stopping flags (``add_stopping_args``)."""
    add_section(parser, RunIO, "run", **defaults)
    add_stopping_args(parser)


def add_stopping_args(parser: argparse.ArgumentParser) -> None:
    """When a run stops early: the flags of ``tpzoo.training.run_config.StoppingConfig``."""
    add_section(parser, StoppingConfig, "stopping")
