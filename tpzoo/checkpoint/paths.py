"""Where a checkpoint lives on disk, how a save is published atomically, and reading it back by path.

    SAVE_DIR/latest                  text: the name of the newest complete checkpoint ("iter_0000300")
    SAVE_DIR/iter_0000300/           one complete checkpoint
        meta.json                    the caller's meta + "iteration" + "checkpoint" (model, mesh, scaler, ...)
        .metadata                    DCP's index: every tensor's full shape and where its chunks are
        __<rank>_0.distcp            the tensors each rank wrote
        manifest.json                every other file's size and sha256, written last (``manifest``)
    SAVE_DIR/iter_0000400.partial/   a save in progress (or one that died): never named by ``latest``

A save writes into the ``.partial`` folder; when every rank has finished, rank 0 renames it to
``iter_NNNNNNN`` and then replaces ``latest`` with ``os.replace`` (atomic on POSIX). A save that
dies before leaves ``latest`` as it was; the next save removes its leftovers (``remove_leftovers``).

``resolve_checkpoint`` checks the folder it returns against its manifest; given a save dir, it falls
back from a damaged ``latest`` to the newest intact iter folder, with a warning naming what it skipped.
No function here needs a process group (``collective=True`` shares the hashing out over one).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tpzoo.checkpoint.manifest import MANIFEST_FILE, check_folder, read_manifest
from tpzoo.checkpoint.reader import read_dcp_metadata

FORMAT, VERSION = "tpzoo-checkpoint", 1
META_FILE, LATEST_FILE, DCP_INDEX = "meta.json", "latest", ".metadata"
PARTIAL, REPLACED = ".partial", ".replaced"
NAME = re.compile(r"iter_(\d{7,})")
logger = logging.getLogger(__name__)
_unchecked: set[Path] = set()  # folders without a manifest already warned about
_warned: set[tuple] = set()  # fallbacks already warned about (a load resolves its path more than once)
EXPECTED = (f"a training checkpoint is a save folder holding `{LATEST_FILE}` or one of its iter_NNNNNNN folders "
            f"(holding {META_FILE} and {DCP_INDEX})")


def iteration_dir(save_dir: str | Path, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def partial_dir(final: Path) -> Path:
    """The temporary sibling a save of ``final`` writes into."""
    return final.with_name(final.name + PARTIAL)


def is_checkpoint(folder: Path) -> bool:
    """True for a complete iteration folder (or a partial one that got as far as its meta.json)."""
    return (folder / META_FILE).is_file() and (folder / DCP_INDEX).is_file()


def _rank0() -> bool:
    return dist.get_rank() == 0 if dist.is_initialized() else os.environ.get("RANK", "0") == "0"


def _load_meta(folder: Path) -> dict[str, Any]:
    """meta.json of the iteration folder ``folder``; ValueError naming the file when it is not a tpzoo meta."""
    path = folder / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): the checkpoint's meta is corrupt") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("checkpoint"), dict) \
            or meta["checkpoint"].get("format") != FORMAT:
        raise ValueError(f"{path} is not a tpzoo checkpoint's meta (no checkpoint.format {FORMAT!r})")
    return meta


def damage(folder: Path, *, collective: bool = False) -> str | None:
    """Why the iteration folder ``folder`` is not an intact checkpoint (its first bad file and what is
    wrong), or None. A manifest that meta.json records (``checkpoint.manifest``) must be there; without
    one (saved before manifests) only meta.json and ``.metadata`` can be checked (read): a warning says
    so, once per folder."""
    if not is_checkpoint(folder):
        return f"{folder} lacks {META_FILE} or {DCP_INDEX}"
    try:
        files = read_manifest(folder)
        problem = None if files is None else check_folder(folder, files, collective=collective)
        meta = _load_meta(folder) if problem is None else None
        if files is None and meta["checkpoint"].get("manifest"):
            return f"{folder / MANIFEST_FILE} is missing although {META_FILE} records one"
        if files is None:
            read_dcp_metadata(folder)  # what can be checked of a folder without a manifest
    except ValueError as e:
        return str(e)
    if files is None and folder not in _unchecked:
        _unchecked.add(folder)
        if _rank0():
            logger.warning("checkpoint %s has no %s (saved before checkpoints had one): its files cannot be "
                           "checked for damage", folder, MANIFEST_FILE)
    return problem


def _newest_intact(save_dir: Path, collective: bool) -> Path:
    """The folder ``save_dir/latest`` names if intact, else the newest intact iter folder (warning naming
    what was skipped and why); ValueError naming each when none is intact."""
    try:
        name = (save_dir / LATEST_FILE).read_text().strip()
    except UnicodeDecodeError as e:
        raise ValueError(f"{save_dir / LATEST_FILE} is not UTF-8 text ({e.reason} at byte {e.start}): it should name "
                         f"an iter_NNNNNNN folder; write the name of the one to resume from into it") from None
    named = save_dir / name
    rest = sorted((p for p in save_dir.iterdir() if NAME.fullmatch(p.name) and p != named and p.is_dir()),
                  key=lambda p: int(NAME.fullmatch(p.name).group(1)), reverse=True)
    skipped = [] if NAME.fullmatch(name) else [f"{LATEST_FILE} names {name!r}, not an iter_NNNNNNN folder"]
    for folder in [named] * bool(NAME.fullmatch(name)) + rest:
        problem = (damage(folder, collective=collective) if folder.is_dir() else
                   f"{folder} is a file, not a checkpoint folder" if folder.exists() else f"{folder} does not exist")
        if problem is None:
            if skipped and _rank0() and (folder, *skipped) not in _warned:
                _warned.add((folder, *skipped))
                instead = f" instead of {name}" if NAME.fullmatch(name) else ""
                logger.warning("%s: loading %s%s (skipped %s)", save_dir, folder.name, instead, "; ".join(skipped))
            return folder
        skipped.append(f"{folder.name}: {problem}")
    raise ValueError(f"{save_dir} holds no intact checkpoint ({'; '.join(skipped)}); resume from another save "
                     f"folder or start a new run without --load")


def resolve_checkpoint(path: str | Path, *, collective: bool = False) -> Path:
    """The intact iteration folder ``path`` means: ``path`` itself, or in a save dir (a folder holding
    ``latest``) the one ``latest`` names, else the newest intact one (with a warning naming the skipped).

    Every folder is checked against its manifest (sizes, then sha256; ``manifest.check_folder``) and its
    meta.json read. ``collective``: every rank of the process group calls this, sharing the hashing.
    FileNotFoundError when ``path`` does not exist; ValueError when it holds no checkpoint, when the
    iteration folder it names is damaged (naming the first bad file), or when a save dir has no intact one.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; {EXPECTED}")
    if (path / LATEST_FILE).is_file():
        return _newest_intact(path, collective)
    if is_checkpoint(path):
        problem = damage(path, collective=collective)
        if problem:
            raise ValueError(f"checkpoint {path} is damaged: {problem}; load an earlier iter_NNNNNNN folder, or pass "
                             f"the save folder {path.parent} to load the newest intact one")
        return path
    if (path / "config.json").is_file():
        raise ValueError(f"{path} is a model folder (config.json), not a training checkpoint; load its weights "
                         f"with tpzoo.checkpoint.load_model; {EXPECTED}")
    hint = ""
    if path.is_dir() and any(NAME.fullmatch(p.name) or p.name.endswith(PARTIAL) for p in path.iterdir()):
        hint = f" (it has iteration folders but no {LATEST_FILE}: pass one of them, if complete)"
    raise ValueError(f"{path} holds no tpzoo checkpoint{hint}; {EXPECTED}")


def read_meta(path: str | Path) -> dict[str, Any]:
    """meta.json of the checkpoint ``path`` resolves to (see ``resolve_checkpoint``)."""
    return _load_meta(resolve_checkpoint(path))


def latest_iteration(save_dir: str | Path) -> int | None:
    """The iteration of the checkpoint ``save_dir/latest`` names, or None when there is none yet."""
    if not (Path(save_dir) / LATEST_FILE).is_file():
        return None
    return read_meta(save_dir)["iteration"]


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_leftovers(save_dir: Path) -> None:
    """Undo what a save that died left behind: delete ``.partial`` folders; a ``.replaced`` folder is the
    previous copy of a re-saved iteration, deleted if the new one got its name, else renamed back."""
    for leftover in sorted(save_dir.glob(f"iter_*{PARTIAL}")):
        shutil.rmtree(leftover)
    for old in sorted(save_dir.glob(f"iter_*{REPLACED}")):
        original = old.with_name(old.name[:-len(REPLACED)])
        if original.exists():
            _remove(old)
        else:
            os.rename(old, original)


def publish(partial: Path, final: Path) -> None:
    """Rename the finished ``partial`` folder to ``final`` and point ``latest`` at it (rank 0 only).

    Re-saving an existing iteration moves the old folder aside first (``remove_leftovers`` restores it
    if this dies between the two renames) and deletes it once ``latest`` is written.
    """
    old = final.with_name(final.name + REPLACED)
    if final.exists():
        os.rename(final, old)
    os.rename(partial, final)
    latest, staging = final.parent / LATEST_FILE, final.parent / (LATEST_FILE + ".tmp")
    with open(staging, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, latest)
    _fsync_dir(final.parent)
    if old.exists():
        _remove(old)


def _remove(path: Path) -> None:
    """Delete the folder or file ``path`` (what was in the way of a checkpoint's name)."""
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
