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


def utf8_text(value: str) -> str:
    """Command-line text that is valid UTF-8 (Python keeps the bytes of argv it cannot decode as lone surrogates,
    which no tokenizer takes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = value[e.start].encode("utf-8", "surrogateescape").hex()
        raise argparse.ArgumentTypeError(f"is not UTF-8 text (byte 0x{byte} at character {e.start}); pass the "
                                         f"text in UTF-8") from None
    return value


MAX_SEED = 2**32 - 1  # seeds are mixed into others (seed + offsets, seed x 1,000,003 + epoch): 64 bits must hold them


def seed(text: str) -> int:
    value = non_negative_int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed in [0, {MAX_SEED}] (32 bits), got {value}")
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


def open_probability(text: str) -> float:
    return _float(text, lambda v: 0 < v < 1, "in (0, 1)")


def megatron_window(text: str) -> int:
    """Megatron-LM's ``--window-size L,R`` (its left and right reach, Transformer Engine's) as tpzoo's window, the
    keys a causal query sees, itself included: L + 1; R must be 0 (a causal model looks at no later token)."""
    parts = text.strip("()").split(",")
    try:
        left, right = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT tokens (for example 4095,0), got {text!r}") from None
    if len(parts) > 2 or left < 0 or right != 0:
        raise argparse.ArgumentTypeError(f"expected LEFT,0 with LEFT >= 0 (a causal model sees no later token), "
                                         f"got {text!r}")
    return left + 1

