"""A checkpoint's manifest: every file's size and sha256, written last by a save and checked before a load.

    iter_0000300/manifest.json   {"format": "tpzoo-manifest", "version": 1,
                                  "files": {"__0_0.distcp": {"size": 4096, "sha256": "9f2c..."}, ...}}

Saving (``tpzoo.checkpoint.save``): once DCP has written the folder, each rank hashes the files it
wrote (``rank_files``) and leaves their entries in a part file (``write_part``); rank 0 merges the
parts (``merge_parts``), writes the manifest (``write_manifest``) and only then publishes the folder.
No collective is involved, so this can run on a thread while training goes on.

Loading: ``check_folder`` compares sizes (every rank, cheap), then sha256; with ``collective`` and a
process group of more than one rank, rank r hashes files r, r + world, ... and the verdict is gathered
(every rank gets the same answer). A folder hashed once is not hashed again in this process while its
files' sizes and modification times are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

MANIFEST_FILE, FORMAT, VERSION = "manifest.json", "tpzoo-manifest", 1
CHUNK = 16 << 20  # bytes read at a time when hashing a file
SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")
RANK0_FILES = (".metadata", "meta.json")
PART_PREFIX, PART_SUFFIX = "manifest.", ".part"  # one rank's hashes, merged into the manifest by rank 0
_verdicts: dict[Path, tuple] = {}  # folder -> (its files' signature, indices of its bad files) in this process


def rank_files(folder: Path, rank: int, extra: Sequence[str] = ()) -> list[str]:
    """The files of ``folder`` that ``rank`` wrote: DCP names a rank's shards ``__<rank>_<n>.distcp``;
    rank 0 also writes the index (``.metadata``), meta.json and the caller's ``extra`` files."""
    own = sorted(p.name for p in folder.iterdir() if SHARD_NAME.fullmatch(p.name) and p.name.startswith(f"__{rank}_"))
    return own + [name for name in (*RANK0_FILES, *extra) if rank == 0 and (folder / name).is_file()]


def write_part(folder: Path, rank: int, error: str | None = None, extra: Sequence[str] = ()) -> None:
    """Hash the files ``rank`` wrote into ``folder`` (``extra``: rank 0's files besides DCP's and meta.json) and
    record them in ``folder/manifest.<rank>.part`` (written whole, then renamed: it appears complete or not at
    all); with ``error``, record that instead."""
    record = {"error": error} if error else {"files": {name: file_entry(folder / name)
                                                       for name in rank_files(folder, rank, extra)}}
    staging = folder / f"{PART_PREFIX}{rank}.tmp"
    staging.write_text(json.dumps(record))
    os.replace(staging, folder / f"{PART_PREFIX}{rank}{PART_SUFFIX}")


class PartError(RuntimeError):
    """A rank's part reports that it failed (that rank raises its own error in ``wait_for_save``)."""


def merge_parts(folder: Path, world: int, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Rank 0: wait (up to ``timeout_s``) for every rank's part in ``folder``, delete them and return
    their files merged. RuntimeError naming the ranks whose part never came; PartError for a rank's error."""
    parts = [folder / f"{PART_PREFIX}{r}{PART_SUFFIX}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while not all(p.is_file() for p in parts):
        if time.monotonic() > deadline:
            late = [r for r, p in enumerate(parts) if not p.is_file()]
            raise RuntimeError(f"{folder}: ranks {late} did not hash their files within {timeout_s:g}s")
        time.sleep(0.02)
    files: dict[str, dict[str, Any]] = {}
    for rank, part in enumerate(parts):
        record = json.loads(part.read_text())
        if "error" in record:
            raise PartError(f"rank {rank}: {record['error']}")
        files.update(record["files"])
        part.unlink()
    return files


def file_entry(path: Path) -> dict[str, Any]:
    """{"size", "sha256"} of the file at ``path``, read in chunks."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": sha.hexdigest()}


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
    cached = _verdicts[folder][1] if folder in _verdicts and _verdicts[folder][0] == signature else None
    share, step = 0, 1
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        share, step = dist.get_rank(), dist.get_world_size()
    if cached is None:
        cached = _bad_files(folder, names, files, range(share, len(names), step))
    elif step == 1:
        return _describe(folder, names, cached)
    if step > 1:  # every rank enters the gather, whether it hashed its share or knew the whole answer
        found: list[Any] = [None] * step
        dist.all_gather_object(found, cached)
        errors = [part for part in found if isinstance(part, str)]
        if errors:
            raise ValueError(errors[0])
        cached = sorted({i for part in found for i in part})
    if not isinstance(cached, str):
        _verdicts[folder] = (signature, cached)
    return _describe(folder, names, cached)


def _bad_files(folder: Path, names: list[str], files: dict[str, dict[str, Any]], indices: range) -> list[int] | str:
    """The indices among ``indices`` of the files whose sha256 differs from the manifest's, or the
    error that kept one from being read (a string: every rank then raises it)."""
    bad = []
    for i in indices:
        try:
            entry = file_entry(folder / names[i])
        except OSError as e:
            return f"{folder / names[i]} cannot be read ({e.strerror or e})"
        if entry["sha256"] != files[names[i]]["sha256"]:
            bad.append(i)
    return bad


def _describe(folder: Path, names: list[str], bad: list[int] | str) -> str | None:
    if isinstance(bad, str):
        raise ValueError(bad)
    return f"{folder / names[min(bad)]}: sha256 differs from the manifest's (the file is corrupt)" if bad else None
