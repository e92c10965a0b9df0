"""Reading a DCP checkpoint without running code from it.

torch.distributed.checkpoint stores its index, ``.metadata``, as a pickle and reads it with
``pickle.load``: a crafted ``.metadata`` runs any code it names the moment a checkpoint is opened.
Here it is read by an unpickler that builds only the classes an index is made of (``ALLOWED``:
DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts, paths) and refuses any other global
with ``UnsafeCheckpointError`` naming the file and the global, before anything runs. The index
must then be shaped as DCP writes it (``_check_index``): tensor entries only (a bytes entry would be
read with ``torch.load(weights_only=False)``, DCP's ``load_bytes``, and tpzoo never writes one), each
chunk stored in a file named bare, beside the index (not ``../../etc/passwd``). The tensors themselves
are read by DCP with ``torch.load(weights_only=True)``, torch's own allow-list.

    metadata = read_dcp_metadata(folder)   # checked, or UnsafeCheckpointError / ValueError naming the file
    load_tensors(state, folder)            # dcp.load through CheckpointReader: the same check, errors name the file

No function here needs a process group.
"""

from __future__ import annotations

import os
import pickle
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

INDEX = ".metadata"
# module -> class names an index may build; torch's dtypes are checked by type instead of listed
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "TensorProperties", "MetadataIndex", "StorageMeta",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to build something a checkpoint never holds: refused, nothing ran."""


class _IndexUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path} asks to load {module}.{name}, which no checkpoint index holds: refused (nothing from it "
            f"ran); the file was crafted or replaced, so do not use this checkpoint (docs/checkpoints.md: what is "
            f"trusted)")


def _plain(value: Any) -> bool:
    """Whether ``value`` is built of plain containers only (dict, list, tuple of str, numbers, None; no subclass)."""
    if type(value) is dict:
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if type(value) in (list, tuple):
        return all(map(_plain, value))
    return value is None or type(value) in (str, int, float, bool)


def _bare_name(name: Any) -> bool:
    """Whether ``name`` is a file name inside the checkpoint folder (no folder part, not absolute, not ``..``)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
            and not (os.altsep and os.altsep in name) and "\0" not in name and not os.path.isabs(name))


def _index_problem(metadata: Any) -> str | None:
    """What makes ``metadata`` other than an index as DCP writes it for tpzoo, or None."""
    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}, not a checkpoint index"
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not all(isinstance(key, str) for key in entries):
        return f"its state_dict_metadata is a {type(entries).__name__}, not a dict keyed by tensor names"
    foreign = [key for key, meta in entries.items() if not isinstance(meta, TensorStorageMetadata)]
    if foreign:
        return (f"it lists {len(foreign)} non-tensor entries ({', '.join(foreign[:3])}), which tpzoo never writes "
                f"and DCP would unpickle")
    if not isinstance(storage, dict):
        return f"its storage_data is a {type(storage).__name__}, not a dict"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return (f"its storage_data maps a {type(index).__name__} to a {type(info).__name__}, not a MetadataIndex "
                    f"to a _StorageInfo")
        if not _bare_name(info.relative_path):
            return (f"its storage_data points {index.fqn} at {info.relative_path!r}, not a file name inside the "
                    f"checkpoint folder")
    if not (metadata.storage_meta is None or isinstance(metadata.storage_meta, StorageMeta)):
        return f"its storage_meta is a {type(metadata.storage_meta).__name__}, not a StorageMeta"
    if not _plain(metadata.planner_data):
        return "its planner_data holds more than plain containers (dict, list, tuple, str, numbers)"
    return None


def _check_index(path: Path, metadata: Any) -> None:
    """UnsafeCheckpointError naming ``path`` and what is wrong unless ``metadata`` is shaped as DCP writes it:
    str -> TensorStorageMetadata entries, MetadataIndex -> _StorageInfo storage in bare file names beside it,
    a StorageMeta or None, plain planner data."""
    try:
        problem = _index_problem(metadata)
    except AttributeError as e:  # a dataclass unpickled without one of its fields
        problem = f"a field is missing ({e})"
    if problem:
        raise UnsafeCheckpointError(f"{path} is not a checkpoint index as tpzoo writes it: {problem}; refused (the "
                                    f"file was crafted or replaced: do not use this checkpoint)")


def _load_index(path: Path) -> Metadata:
    """The ``Metadata`` pickled in ``path``, built from ``ALLOWED`` classes only and shaped as DCP writes it
    (``_check_index``)."""
    try:
        with open(path, "rb") as f:
            metadata = _IndexUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete") from None
    except Exception as e:  # truncated or garbled: EOFError, UnpicklingError, ValueError, ... from the bytes
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {e}): the checkpoint index is truncated or "
                         f"corrupt") from None
    _check_index(path, metadata)
    return metadata


class _TrackedFileSystem(FileSystem):
    """DCP's local file system, remembering the last file it opened (the one a read failed in)."""

    opened: str | None = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        self.opened = str(path)
        with super().create_stream(path, mode) as stream:
            yield stream


def _why(error: Exception) -> str:
    """What went wrong reading a shard, in a few words. torch's refusal of a pickle advises loading it with
    weights_only=False, the one thing a user must never do with a checkpoint they did not write: never quoted."""
    text = " ".join(str(error).split())
    if found := re.search(r"Unsupported global: GLOBAL ([\w.]+)", text):
        return f"its pickle asks to load {found.group(1)}, which no checkpoint holds"
    if "weights_only" in text:
        return "its pickle is refused by the safe loader"
    return f"{type(error).__name__}: {text[:300]}"


class CheckpointReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with the index read by ``read_dcp_metadata``'s allow-list unpickler,
    and a failed tensor read reported as a ValueError naming its file."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _TrackedFileSystem()

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().read_data(plan, planner)
        except Exception as e:  # a truncated shard, or one whose pickle torch.load(weights_only=True) refuses
            raise ValueError(f"{self.fs.opened} is unreadable ({_why(e)}): the checkpoint's tensors are truncated, "
                             f"corrupt or crafted") from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP asks for a per-rank index (``__<rank>.metadata``) in no-collective loads
        metadata = _load_index(Path(self.path) / (INDEX if rank is None else f"__{rank}{INDEX}"))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_tensors(state: dict[str, Any], folder: str | Path) -> None:
    """``dcp.load(state)`` from the checkpoint ``folder`` through ``CheckpointReader`` (collective); a failure
    on any rank is a ValueError naming the file, not DCP's multi-rank traceback (a BaseException)."""
    try:
        dcp.load(state, storage_reader=CheckpointReader(folder))
    except CheckpointException as e:
        rank, (error, _) = next(iter(e.failures.items()))
        if isinstance(error, ValueError):
            raise ValueError(str(error)) from None
        raise ValueError(f"loading {folder} failed on rank {rank}: {type(error).__name__}: {error}") from None


def read_dcp_metadata(folder: str | Path) -> Metadata:
    """The checked DCP index of the checkpoint ``folder`` (see the module docstring).

    UnsafeCheckpointError (a ValueError) when it names a class outside ``ALLOWED`` or holds non-tensor
    entries; ValueError naming the file when it is truncated or garbled; FileNotFoundError when missing.
    """
    return _load_index(Path(folder) / INDEX)
