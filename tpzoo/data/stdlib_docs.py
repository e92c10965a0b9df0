"""Real text on every machine with Python: the docstrings of the standard library, labelled by the
chapter of the Python Library Reference their module belongs to (``FAMILIES``).

Read from the installed sources with ``ast`` (nothing is imported or run): every module, class and
function docstring of at least ``MIN_CHARS`` characters, whitespace collapsed to one line, each
text once (``ntpath`` and ``posixpath`` share many). ``export`` writes three jsonl files:

- ``valid.jsonl``: ``{"text", "label"}``, a fifth of the labelled docstrings (chosen by a hash of
  the text, so the same on every run), the label a family name (``"network"``, ...);
- ``train.jsonl``: ``{"text", "label"}``, ``per_class`` docstrings of each family from the rest (few
  labels, as in practice: labelling is what costs);
- ``corpus.jsonl``: ``{"text"}``, every docstring of the library but the validation ones, labelled
  or not (pretraining text: what is cheap).

The text differs between Python versions; the files record nothing else.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import sysconfig
from collections import defaultdict
from pathlib import Path
from typing import Iterator

from tpzoo.data.sources import write_jsonl

MIN_CHARS = 40
VALID_SHARE = 5  # one docstring in VALID_SHARE validates
SKIPPED = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo"}
# Library Reference chapters (https://docs.python.org/3/library/), top-level modules as this package names them
FAMILIES = {
    "text": "string re difflib textwrap unicodedata stringprep codecs html gettext locale shlex",
    "numbers": "numbers math cmath decimal fractions random statistics",
    "files": "pathlib os shutil glob fnmatch tempfile filecmp stat fileinput io linecache ntpath posixpath genericpath",
    "storage": "zlib gzip bz2 lzma zipfile tarfile csv configparser netrc plistlib pickle shelve dbm sqlite3 copyreg",
    "concurrency": "threading multiprocessing concurrent subprocess sched queue asyncio contextvars selectors",
    "network": "socket ssl http urllib ftplib poplib imaplib smtplib uuid socketserver xmlrpc ipaddress email "
               "mailbox mimetypes base64 binascii quopri json",
    "devtools": "typing pydoc doctest unittest pdb bdb cProfile profile pstats timeit trace tracemalloc inspect ast "
                "dis tokenize symtable traceback warnings",
}
FAMILY_OF = {module: family for family, modules in FAMILIES.items() for module in modules.split()}


def docstrings(root: str | os.PathLike | None = None) -> Iterator[tuple[str, str]]:
    """(top-level module, docstring on one line) of every source file under ``root`` (default: this Python's
    standard library), in path order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if SKIPPED.intersection(parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a template or another Python's file
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = " ".join((ast.get_docstring(node) or "").split())
                if len(text) >= MIN_CHARS:
                    yield parts[0].removesuffix(".py"), text


def is_validation(text: str) -> bool:
    return hashlib.sha256(text.encode()).digest()[0] % VALID_SHARE == 0


def export(out: str | os.PathLike, per_class: int = 50, seed: int = 0,
           root: str | os.PathLike | None = None) -> dict[str, int]:
    """Write ``corpus.jsonl``, ``train.jsonl`` and ``valid.jsonl`` into ``out`` (above); their row counts."""
    if per_class < 1:
        raise ValueError(f"per_class must be at least 1, got {per_class}")
    seen: set[str] = set()
    corpus, labelled, valid = [], defaultdict(list), []
    for module, text in docstrings(root):
        if text in seen:
            continue
        seen.add(text)
        family = FAMILY_OF.get(module)
        if is_validation(text):
            if family:
                valid.append({"text": text, "label": family})
            continue
        corpus.append({"text": text})
        if family:
            labelled[family].append({"text": text, "label": family})
    if not valid:
        raise ValueError(f"no docstring of the families' modules under {root or 'the standard library'}")
    rng = random.Random(seed)
    train = [row for family in FAMILIES for row in rng.sample(labelled[family], min(per_class, len(labelled[family])))]
    rng.shuffle(train)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("corpus", corpus), ("train", train), ("valid", valid)):
        write_jsonl(out / f"{name}.jsonl", rows)
    return {"corpus": len(corpus), "train": len(train), "valid": len(valid)}
