"""``--model``, the flag every command shares: a registered model family, or ``module:NAME``, a family from
outside tpzoo that is imported and registered as the command line is read (``resolve_family``)."""

from __future__ import annotations

import argparse

from tpzoo.fields import parses, string
from tpzoo.models.families import resolve_family

OUTSIDE = ("the family of a model from outside tpzoo: module:NAME, a tpzoo.models.Family, its module imported first "
           "(docs/new-model.md)")


def model_flag(value: str) -> str:
    """The argparse type of ``--model``: ``value``, once ``resolve_family`` found (or imported) its family."""
    try:
        resolve_family(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


@parses(model_flag)
def family_name(value: object) -> str | None:
    """The check of a ``--model`` field: a string, read by ``model_flag``."""
    return string(value)


def add_model_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, help: str = OUTSIDE,
                   metavar: str = "MODULE:NAME", **kwargs: object) -> None:
    """``--model`` on ``parser`` (by default: on a command that loads a model, for a family from outside tpzoo)."""
    parser.add_argument("--model", metavar=metavar, type=model_flag, help=help, **kwargs)
