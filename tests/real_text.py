"""Real technical English that nobody here wrote: the documentation of Python's standard library,
as long documents without line breaks (one per module: its docstring and those of its public
functions and classes, whitespace collapsed). The same text for the same Python version."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

MODULES = ("argparse", "asyncio", "collections", "csv", "datetime", "decimal", "email", "fractions", "functools",
           "glob", "gzip", "heapq", "http.client", "inspect", "ipaddress", "itertools", "json", "logging", "os",
           "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess",
           "tarfile", "tempfile", "textwrap", "threading", "time", "typing", "unittest", "urllib.parse", "uuid",
           "zipfile", "zlib")


def docstrings(module_name: str) -> list[str]:
    """The docstrings of a module and of its public functions and classes, as written."""
    module = importlib.import_module(module_name)
    public = [obj for name, obj in sorted(vars(module).items()) if not name.startswith("_")]
    docs = [inspect.getdoc(module)] + [inspect.getdoc(obj) for obj in public if inspect.isfunction(obj)
                                       or inspect.isclass(obj)]
    return [doc for doc in docs if doc]


def one_line(text: str) -> str:
    return " ".join(text.split())


def documents(min_chars: int = 500) -> list[str]:
    """One document per module of ``MODULES`` with at least ``min_chars`` characters, no line breaks."""
    docs = [one_line(" ".join(docstrings(name))) for name in MODULES]
    return [doc for doc in docs if len(doc) >= min_chars]


def paragraphs(module_name: str, min_chars: int = 150, max_chars: int = 10_000) -> list[str]:
    """The prose paragraphs (no doctest, no table) of a module's docstrings, each on one line."""
    out = [one_line(p) for doc in docstrings(module_name) for p in doc.split("\n\n")]
    return [p for p in out if min_chars <= len(p) <= max_chars and not p.startswith((">>>", "+-"))]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path
