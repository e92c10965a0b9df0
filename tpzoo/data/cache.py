"""Build-once folders under the tpzoo cache (``$TPZOO_CACHE``, default ``~/.cache/tpzoo``).

A folder is built in a temporary sibling under a file lock and renamed into place, so concurrent
processes (every rank of a job) build it once and never see it half written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from filelock import FileLock


def cache_dir() -> Path:
    """The cache root: ``$TPZOO_CACHE`` if set, else ``~/.cache/tpzoo``."""
    return Path(os.environ.get("TPZOO_CACHE") or Path.home() / ".cache" / "tpzoo")


def cached_build(name: str, build: Callable[[Path], None]) -> Path:
    """``cache_dir()/name``, calling ``build(folder)`` to fill it the first time."""
    final = cache_dir() / name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if not final.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent))
            try:
                build(tmp)
                tmp.chmod(0o755)
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final
