"""Megatron-LM flags that tpzoo refuses: a launch line copied from Megatron-LM stops at the first one
with one line saying why (exit status 2, before torch loads), instead of the flag being accepted and
ignored. The table is data, ``megatron_refused.toml`` beside this module (one entry per reason: the clause
and its flags); docs/megatron.md lists every Megatron-LM flag as supported or refused."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TABLE = Path(__file__).with_suffix(".toml")
# Megatron-LM flag -> why tpzoo does not support it (one clause), in the table's order
REFUSED: dict[str, str] = {flag: entry["why"] for entry in tomllib.loads(TABLE.read_text())["refused"]
                           for flag in entry["flags"].split()}


class _Refuse(argparse.Action):
    """Takes any number of values, then ends parsing with the flag's one-line refusal."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> NoReturn:
        parser.error(f"{option_string} is a Megatron-LM flag tpzoo does not support: {REFUSED[self.dest_flag]}")

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS, **kwargs)
        self.dest_flag = option_strings[0]


def add_refused_args(parser: argparse.ArgumentParser) -> None:
    """Define every REFUSED flag the parser does not already have (call it after every other group,
    so a flag tpzoo implements is never shadowed by its refusal)."""
    group = parser.add_argument_group("Megatron-LM flags tpzoo refuses (docs/megatron.md)")
    for flag in REFUSED:
        if flag not in parser._option_string_actions:
            group.add_argument(flag, action=_Refuse, help=argparse.SUPPRESS)
