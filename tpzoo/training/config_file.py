"""Run configuration files for pretrain.py and finetune.py: ``--config run.toml`` (or ``run.yaml``, the same
sections and keys) and ``--print-config``.

A file holds a command's flags in sections named after its flag groups (the headings of ``--help``), each key
a flag's destination (Megatron-LM's name with underscores; docs/config.md lists every key)::

    [model]
    model = "llama"
    num_layers = 4

    [parallel]
    tp = 2
    sequence_parallel = true

    [batch_and_optimizer]
    rampup_batch_size = [16, 16, 1000]

A file stands for the flags it spells, placed before the command line's: a flag given overrides the file,
the file's keys count as given (a resume restores the others from the checkpoint), and each value passes the
flag's own checks. An unknown section or key, a value of the wrong kind or out of range is a ValueError
naming the file, the section and the key. ``--print-config`` prints the resolved flags in this form (every
value the run takes, defaults included) and exits; the file fed back with ``--config`` reproduces the run.
Imports without torch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_FILE = "config.toml"  # the resolved flags in a run folder
# argparse's own groups hold --help and the configuration flags themselves; the refused flags are never values
_NO_SECTION = ("positional arguments", "options", "Megatron-LM flags tpzoo refuses (docs/megatron.md)")


class Unfilled(argparse.Namespace):
    """A namespace that claims to hold every attribute, so argparse fills in no defaults and only the
    flags actually given land in it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return None


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` (expanded by ``CommandParser`` before parsing) and ``--print-config``."""
    parser.add_argument("--config", metavar="FILE", help="a TOML file of flags (docs/config.md); flags given "
                        "override it")
    parser.add_argument("--print-config", action="store_true", help="print the resolved flags as a --config "
                        "file and exit")


def section_name(title: str) -> str:
    """The file section of a flag group: its title before any parenthesis, words joined by underscores
    ("batch and optimizer" -> batch_and_optimizer, "model architecture (Megatron-LM's flags)" -> model_architecture)."""
    return re.sub(r"\W+", "_", title.split(" (")[0]).strip("_").lower()


def sections(parser: argparse.ArgumentParser) -> dict[str, dict[str, list[argparse.Action]]]:
    """section -> destination -> the options that set it (``--add-bias-linear`` and ``--disable-bias-linear``
    share one), in the parser's order."""
    out: dict[str, dict[str, list[argparse.Action]]] = {}
    for group in parser._action_groups:
        if group.title in _NO_SECTION:
            continue
        keys = out.setdefault(section_name(group.title), {})
        for action in group._group_actions:
            keys.setdefault(action.dest, []).append(action)
    return out


def _tokens(actions: list[argparse.Action], value: Any) -> list[str] | None:
    """The command-line words for ``value`` of a destination set by ``actions``; None when the value is not of a
    kind they take."""
    for action in actions:
        if isinstance(action, argparse.BooleanOptionalAction):
            if isinstance(value, bool):
                return [action.option_strings[0 if value else 1]]
        elif action.nargs == 0:  # a switch: the one whose stored constant is the value
            if isinstance(value, bool) and action.const is value:
                return [action.option_strings[0]]
        elif not isinstance(value, (bool, dict)):
            if isinstance(value, list):
                return [action.option_strings[0], *map(str, value)] if action.nargs not in (None, "?") else None
            return [action.option_strings[0], str(value)]
    if isinstance(value, bool) and all(a.nargs == 0 for a in actions):
        return []  # the value no switch sets: the switches not given
    return None


def read_file(path: str) -> dict[str, Any]:
    """The sections of the TOML file ``path``, or of the YAML file (``.yaml``, ``.yml``: the same sections and keys,
    read by PyYAML, which ``datasets`` installs); ValueError naming the file for one that cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    if not path.endswith((".yaml", ".yml")):
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path}: not a TOML file ({e})") from None
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not a YAML file ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: a YAML file of sections (model:, parallel: ...), got {data!r}")
    return data


def file_argv(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags ``path`` spells, checked: ValueError naming the file, section and key for anything wrong."""
    data = read_file(path)
    known = sections(parser)
    owner = {dest: name for name, keys in known.items() for dest in keys}
    argv: list[str] = []
    for name, keys in data.items():
        if name not in known:
            where = f"; {name} is a key of [{owner[name]}]" if name in owner else ""
            raise ValueError(f"--config {path}: no section [{name}]; the sections are {', '.join(known)}{where}")
        if not isinstance(keys, dict):
            raise ValueError(f"--config {path}: [{name}] must be a section of keys, got {keys!r}")
        for key, value in keys.items():
            if key not in known[name]:
                where = f" ({key} is a key of [{owner[key]}])" if key in owner else ""
                raise ValueError(f"--config {path}: [{name}] has no key {key}{where}; its keys: "
                                 f"{', '.join(known[name])}")
            words = _tokens(known[name][key], value)
            if words is None:
                raise ValueError(f"--config {path}: [{name}] {key} = {value!r} is not a value "
                                 f"{'/'.join(known[name][key][0].option_strings)} takes")
            with _raising(parser):
                try:
                    checked = parser.parse_args(words, Unfilled())
                except ValueError as e:
                    raise ValueError(f"--config {path}: [{name}] {key} = {value!r}: {e}") from None
            quoted = isinstance(value, str) and not path.endswith((".yaml", ".yml"))  # YAML reads 1e-3 as text
            if quoted and isinstance(getattr(checked, key, None), (int, float)):
                raise ValueError(f"--config {path}: [{name}] {key} = {value!r}: a number, not a string; drop the "
                                 f"quotes")
            argv += words
    return argv


@contextlib.contextmanager
def _raising(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Within it the parser's errors are ValueErrors instead of an exit."""

    def error(message: str):
        raise ValueError(message)

    parser.error = error  # type: ignore[method-assign]
    try:
        yield
    finally:
        del parser.error


def expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the flags of FILE, put first (flags given override them)."""
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            return [*file_argv(parser, argv[i + 1]), *argv[:i], *argv[i + 2:]]
        if word.startswith("--config="):
            return [*file_argv(parser, word.split("=", 1)[1]), *argv[:i], *argv[i + 1:]]
    return argv


def _toml(value: Any) -> str:
    """A TOML value of a flag's value (str, bool, number or a list of them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_toml, value)) + "]"
    # TOML basic strings escape like JSON's; hand-written since tomllib only reads (no writer in the standard library)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(parser: argparse.ArgumentParser, flags: Mapping[str, Any], described: bool = False) -> str:
    """The values of ``flags`` (by destination) as a --config file: every section's keys that hold a value (None:
    not set).
    ``described``: a new run's --model was not given, so the architecture flags picked the family (with
    Megatron-LM's defaults for what they leave out: tied, one kv head per head); it stays out of the file, for
    them to pick again."""
    lines = []
    for name, keys in sections(parser).items():
        values = [(k, flags[k]) for k in keys if flags.get(k) is not None and not (described and k == "model")]
        if values:
            lines += [f"[{name}]", *(f"{k} = {_toml(v)}" for k, v in values), ""]
    return "\n".join(lines)


def print_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 resolve: Callable[[dict[str, Any] | None], Any], described: bool = False) -> None:
    """Print ``args`` resolved as a --config file. ``resolve(saved_args)`` resolves them in place: the flags
    recorded by --load's checkpoint (None without --load, when --load is the --save folder holding none yet, or a model
    folder, whose weights start a new run). ``described``: --model was not given (``to_toml``; a resume's family is its
    checkpoint's)."""
    from tpzoo.checkpoint import read_meta
    from tpzoo.fields import section_of
    from tpzoo.training.checkpoint_args import RunIO, first_run, model_folder_record

    resumed = (args.load is not None and not first_run(section_of(RunIO, vars(args)))
               and model_folder_record(args.load) is None)
    saved = read_meta(args.load).get("args", {}) if resumed else None
    resolve(saved)
    if os.environ.get("RANK", "0") == "0":
        print(to_toml(parser, vars(args), described=described and saved is None), end="")


def write_config(folder: Path, text: str) -> None:
    """``folder``/config.toml: ``text``, a run's resolved flags as a --config file (rank 0 writes it)."""
    if os.environ.get("RANK", "0") == "0":
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(text)


def reference(parser: argparse.ArgumentParser) -> str:
    """docs/config.md's table of ``parser``'s sections: key, flags, default, meaning."""
    out = []
    for name, keys in sections(parser).items():
        out += [f"### [{name}]", "", "| key | flags | default | meaning |", "| --- | --- | --- | --- |"]
        for key, actions in keys.items():
            flags = " ".join(f"`{s}`" for a in actions for s in a.option_strings)
            default = actions[0].default
            shown = "" if default is None or default is argparse.SUPPRESS else f"`{_toml(default)}`"
            meaning = " ".join((next((a.help for a in actions if a.help), "") or "").split()).replace("|", "\\|")
            out.append(f"| {key} | {flags} | {shown} | {meaning.replace('%(default)s', str(default))} |")
        out.append("")
    return "\n".join(out)
