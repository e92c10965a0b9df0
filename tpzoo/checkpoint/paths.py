"""Where a checkpoint lives on disk, how a save is published atomically, and reading it back by path.

    SAVE_DIR/latest                  text: the name of the newest complete checkpoint ("iter_0000300")
    SAVE_DIR/iter_0000300/           one complete checkpoint
        meta.json                    the caller's meta + "iteration" + "checkpoint" (model, mesh, scaler, ...)
        .metadata                    DCP's index: every tensor's full shape and where its chunks are
        __<rank>_0.distcp            the tensors each rank wrote
    SAVE_DIR/iter_0000400.partial/   a save in progress (or one that died): never named by ``latest``

A save writes into the ``.partial`` folder; when every rank has finished, rank 0 renames it to
``iter_NNNNNNN`` and then replaces ``latest`` with ``os.replace`` (atomic on POSIX). A save that
dies before leaves ``latest`` as it was; the next save removes its leftovers (``remove_leftovers``).
No function here needs a process group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

FORMAT, VERSION = "tpzoo-checkpoint", 1
META_FILE, LATEST_FILE, DCP_INDEX = "meta.json", "latest", ".metadata"
PARTIAL, REPLACED = ".partial", ".replaced"
NAME = re.compile(r"iter_(\d{7,})")
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


def resolve_checkpoint(path: str | Path) -> Path:
    """The iteration folder ``path`` means: ``path`` itself, or the one its ``latest`` file names.

    FileNotFoundError when it does not exist (or ``latest`` names a missing folder); ValueError when
    it holds no checkpoint, naming what was expected.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; {EXPECTED}")
    if (path / LATEST_FILE).is_file():
        name = (path / LATEST_FILE).read_text().strip()
        target = path / name
        if not NAME.fullmatch(name) or not is_checkpoint(target):
            raise FileNotFoundError(f"{path / LATEST_FILE} names {name!r}, which is not a complete checkpoint "
                                    f"folder in {path}; point {LATEST_FILE} at an existing iter_NNNNNNN folder")
        return target
    if is_checkpoint(path):
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
    folder = resolve_checkpoint(path)
    meta = json.loads((folder / META_FILE).read_text())
    if meta.get("checkpoint", {}).get("format") != FORMAT:
        raise ValueError(f"{folder / META_FILE} is not a tpzoo checkpoint's meta (no checkpoint.format {FORMAT!r})")
    return meta


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
            shutil.rmtree(old)
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
        shutil.rmtree(old)
