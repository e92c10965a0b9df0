"""The value types of command-line flags (argparse ``type=``), importable without torch by every command:
each takes the flag's text and returns the value, or raises ``argparse.ArgumentTypeError`` saying what
was expected and what was given (argparse turns it into the command's one-line error)."""

from __future__ import annotations

import argparse
import math
from typing import Callable


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _float(text: str, ok: Callable[[float], bool], expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected a number {expected}, got {text}")
    return value


def positive_float(text: str) -> float:
    return _float(text, lambda v: v > 0 and math.isfinite(v), "> 0")


def non_negative_float(text: str) -> float:
    return _float(text, lambda v: v >= 0 and math.isfinite(v), ">= 0")


def probability(text: str) -> float:
    return _float(text, lambda v: 0 <= v < 1, "in [0, 1)")
