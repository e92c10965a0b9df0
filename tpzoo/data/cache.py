"""Build-once folders under the tpzoo cache: ``--data-cache-path``, else ``$TPZOO_CACHE``, else
``~/.cache/tpzoo``.

A folder is built in a temporary sibling under a file lock and renamed into place, so concurrent
processes (every rank of a job) build it once and never see it half written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from tpzoo.data.progress import is_main_process, say


def cache_dir(root: str | os.PathLike | None = None) -> Path:
    """The cache root, absolute: ``root`` if given, else ``$TPZOO_CACHE`` if set, else ``~/.cache/tpzoo``."""
    return Path(root or os.environ.get("TPZOO_CACHE") or Path.home() / ".cache" / "tpzoo").expanduser().absolute()


def cached_build(name: str, build: Callable[[Path], None], root: str | os.PathLike | None = None) -> Path:
    """``cache_dir(root)/name``, calling ``build(folder)`` to fill it the first time. A process that
    waits for another one's build says so (on rank 0)."""
    final = cache_dir(root) / name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(final) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if is_main_process():
            say(f"waiting for another process to finish building {final}")
        lock.acquire()
    try:
        if not final.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent))
            try:
                build(tmp)
                tmp.chmod(0o755)
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        lock.release()
    return final
