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


def _docs(module_name: str) -> str:
    module = importlib.import_module(module_name)
    parts = [inspect.getdoc(module) or ""]
    for name, obj in sorted(vars(module).items()):
        if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)):
            parts.append(inspect.getdoc(obj) or "")
    return " ".join(" ".join(parts).split())


def documents(min_chars: int = 500) -> list[str]:
    """One document per module of ``MODULES`` with at least ``min_chars`` characters, no line breaks."""
    return [doc for doc in map(_docs, MODULES) if len(doc) >= min_chars]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path
