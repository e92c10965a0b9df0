"""A checkpoint's manifest: every file's size and sha256, written last by a save and checked before a load.

    iter_0000300/manifest.json   {"format": "tpzoo-manifest", "version": 1,
                                  "files": {"__0_0.distcp": {"size": 4096, "sha256": "9f2c..."}, ...}}

Saving: DCP writes through ``HashingWriter``, a ``FileSystemWriter`` whose streams hash the bytes as they
go out, each large chunk hashed by a helper thread while it is written (hashlib and file writes both
release the GIL: a save costs about max(write, hash), not their sum). Each rank hashes the shard files it
wrote; ``gather_hashes`` merges them on rank 0, whose ``write_manifest`` adds meta.json.

Loading: ``check_folder`` compares sizes (every rank, cheap), then sha256; with ``collective`` and a
process group of more than one rank, rank r hashes files r, r + world, ... and the verdict is gathered
(every rank gets the same answer). A folder hashed once is not hashed again in this process while its
files' sizes and modification times are unchanged.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

MANIFEST_FILE, FORMAT, VERSION = "manifest.json", "tpzoo-manifest", 1
CHUNK = 1 << 20  # writes at least this long are hashed by the helper thread while they are written
_verdicts: dict[Path, tuple] = {}  # folder -> (its files' signature, the problem found or None) in this process


class _HashingStream:
    """A binary file opened for writing whose bytes also go through sha256 (one write at a time)."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes < CHUNK:
            self.sha.update(view)
            written = self.raw.write(view)
        else:  # hash on a helper thread while this one writes; wait for both before the caller reuses data
            hasher = threading.Thread(target=self.sha.update, args=(view,))
            hasher.start()
            try:
                written = self.raw.write(view)
            finally:
                hasher.join()
        self.size += view.nbytes
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return self.raw.closed


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording {file name: {"size", "sha256"}} of every file it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.hashes: dict[str, dict[str, Any]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream  # type: ignore[misc]
        self.hashes[Path(path).name] = {"size": stream.size, "sha256": stream.sha.hexdigest()}

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.hashes:  # .metadata is written as .metadata.tmp, then renamed
            self.hashes[Path(new_path).name] = self.hashes.pop(Path(path).name)


class HashingWriter(FileSystemWriter):
    """``FileSystemWriter(folder)`` that keeps ``hashes``: {name: {"size", "sha256"}} of the files this rank wrote."""

    def __init__(self, folder: str | Path) -> None:
        super().__init__(folder)
        self.fs = _HashingFileSystem()

    @property
    def hashes(self) -> dict[str, dict[str, Any]]:
        return self.fs.hashes


def file_entry(path: Path) -> dict[str, Any]:
    """{"size", "sha256"} of the file at ``path``, read in chunks."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(16 * CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": sha.hexdigest()}


def gather_hashes(hashes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """Collective: every rank's ``hashes`` (``HashingWriter.hashes``) merged on rank 0; None on the others."""
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(hashes, gathered, dst=0)
    return None if gathered is None else {name: entry for part in gathered for name, entry in part.items()}


def write_manifest(folder: Path, files: dict[str, dict[str, Any]], extra: tuple[str, ...]) -> None:
    """Write ``folder/manifest.json`` (synced) listing ``files`` plus the files ``extra`` (hashed from disk)."""
    files = {**files, **{name: file_entry(folder / name) for name in extra}}
    text = json.dumps({"format": FORMAT, "version": VERSION, "files": dict(sorted(files.items()))}, indent=1)
    with open(folder / MANIFEST_FILE, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's {name: {"size", "sha256"}}, or None when the folder has none (written before
    manifests existed). ValueError naming the file when it is not a manifest."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        files = record["files"] if record.get("format") == FORMAT else None
        if not isinstance(files, dict) or not all(isinstance(e, dict) and isinstance(e.get("size"), int)
                                                  and isinstance(e.get("sha256"), str) for e in files.values()):
            raise ValueError("no files with size and sha256")
    except (ValueError, UnicodeDecodeError, AttributeError, KeyError) as e:
        raise ValueError(f"{path} is not a {FORMAT} file ({e}): the manifest is corrupt") from None
    return files


def _signature(folder: Path, names: list[str]) -> tuple:
    stats = [(folder / name).stat() for name in [MANIFEST_FILE, *names]]
    return tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in stats)


def _size_problem(path: Path, expected: int) -> str | None:
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    return None if size == expected else f"{path} has {size} bytes, the manifest says {expected} (truncated or rewritten)"


def check_folder(folder: Path, files: dict[str, dict[str, Any]], *, collective: bool = False) -> str | None:
    """The first file of ``folder`` (manifest order) whose size or sha256 differs from ``files`` (the
    manifest), described, or None when all match. ``collective``: every rank of the default process
    group calls this (when there is one of more than one rank), and each hashes a share of the files."""
    names = list(files)
    for name in names:
        problem = _size_problem(folder / name, files[name]["size"])
        if problem:
            return problem
    signature = _signature(folder, names)
    if folder in _verdicts and _verdicts[folder][0] == signature:
        return _verdicts[folder][1]
    share, step = 0, 1
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        share, step = dist.get_rank(), dist.get_world_size()
    bad = [i for i in range(share, len(names), step)
           if file_entry(folder / names[i])["sha256"] != files[names[i]]["sha256"]]
    if step > 1:
        found: list[Any] = [None] * step
        dist.all_gather_object(found, bad)
        bad = [i for part in found for i in part]
    problem = f"{folder / names[min(bad)]}: sha256 differs from the manifest's (the file is corrupt)" if bad else None
    _verdicts[folder] = (signature, problem)
    return problem
