"""Read documents (strings) from local json/jsonl/txt/parquet/csv files through ``datasets``, and
what ``--dataset`` names (``DatasetSource``): such files, a folder written by ``datasets``'
``save_to_disk``, or a dataset name that ``datasets`` finds in its local cache (never the network).

Files are streamed (``streaming=True``), so reading is constant-memory whatever the corpus size.
A ``.txt`` file holds one document per paragraph (documents are separated by blank lines, one
sentence or line per line inside, the layout BERT's original pretraining data used); json/jsonl
/parquet/csv files hold one document per row under a chosen key.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}
# tsv files (GLUE's among them) are read unquoted; csv cells "NA"/"null" stay text.
_OPTIONS = {
    ".txt": {"sample_by": "paragraph"},
    ".csv": {"keep_default_na": False},
    ".tsv": {"delimiter": "\t", "quoting": csv.QUOTE_NONE, "keep_default_na": False},
}


def resolve_files(inputs: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Expand files, folders and glob patterns into a sorted list of readable files.

    Raises FileNotFoundError for a path that matches nothing and ValueError for an unknown suffix.
    """
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not items:
        raise ValueError(f"no input files given; pass at least one {'/'.join(BUILDERS)} file")
    files: list[str] = []
    for item in map(str, items):
        if os.path.isdir(item):
            found = sorted(f for f in glob.glob(os.path.join(item, "**", "*"), recursive=True) if _builder(f))
            if not found:
                raise FileNotFoundError(f"folder {item!r} holds no {'/'.join(BUILDERS)} files")
        else:
            found = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
            if not found or not os.path.isfile(found[0]):
                raise FileNotFoundError(f"input file {item!r} does not exist; check the path")
        for f in found:
            if _builder(f) is None:
                raise ValueError(f"cannot read {f!r}: the suffix must be one of {', '.join(BUILDERS)}")
        files.extend(found)
    return files


def one_file(path: str) -> str:
    """``path`` as ``resolve_files`` finds it, checked to be exactly one file (not a folder, nor a
    glob of several): ValueError otherwise."""
    files = resolve_files(path)
    if os.path.isdir(path) or len(files) != 1:
        what = "is a folder" if os.path.isdir(path) else f"matches {len(files)} files"
        raise ValueError(f"{path!r} {what}; pass one {'/'.join(BUILDERS)} file")
    return files[0]


def _builder(path: str) -> str | None:
    return BUILDERS.get(os.path.splitext(path)[1].lower())


def rows(path: str, **options: Any) -> Iterator[dict[str, Any]]:
    """Stream the rows of one file as dicts (``options`` go to the ``datasets`` builder, e.g. a
    csv/tsv file's ``column_names`` and ``header``); an empty or malformed file raises ValueError
    naming it (and, for json/jsonl, the first bad line)."""
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its parse errors come back as ours, in one line
    datasets.disable_progress_bars()
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path!r} is empty (0 bytes); fill it or pick another file")
    options = {**_OPTIONS.get(os.path.splitext(path)[1].lower(), {}), **options}
    try:
        stream = datasets.load_dataset(_builder(path), data_files=[path], split="train", streaming=True, **options)
        for row in stream:
            if "__index_level_0__" in row:  # pandas took the surplus leading fields for an index
                raise ValueError("its rows have more fields than its header")
            yield row
    except (ValueError, OSError) as e:  # pandas' and pyarrow's parse errors are ValueErrors
        where = _bad_json_line(path) if _builder(path) == "json" else None
        reason = where or (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise ValueError(f"cannot parse {path!r}: {reason}; fix the file") from None


def _bad_json_line(path: str) -> str | None:
    """Where json/jsonl ``path`` stops being JSON: ``line N (1-based): why``, or None if every line parses."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith(b"["):  # one JSON document, or JSON lines of arrays (read on below)
            try:
                json.loads(f.read())
            except UnicodeDecodeError as e:
                return f"byte {e.start} is not UTF-8 (a binary file?)"
            except ValueError as e:
                if e.msg != "Extra data":
                    return f"line {e.lineno}, column {e.colno}: {e.msg.removesuffix(' at')}"
            else:
                return None
            f.seek(0)
        for number, line in enumerate(f, 1):
            try:
                value = json.loads(line) if line.strip() else {}
            except UnicodeDecodeError:
                return f"line {number} is not UTF-8 text (a binary file?)"
            except ValueError as e:
                return f"line {number}, column {e.colno}: {e.msg.removesuffix(' at')}"
            if not isinstance(value, dict):
                return (f'line {number} holds {_json_kind(value)}, not an object: each line is one object, e.g. '
                        f'{{"text": "..."}}')
    return None


_JSON_KINDS = ((bool, "a boolean"), ((int, float), "a number"), (list, "an array"), (dict, "an object"),
               (str, "a string"), (type(None), "null"))


def _json_kind(value: Any) -> str:
    """What JSON calls ``value``'s kind: "a number", "null", ..."""
    return next((name for types, name in _JSON_KINDS if isinstance(value, types)), type(value).__name__)


def row_place(path: str, number: int) -> str:
    """Where row ``number`` (1-based) of ``path`` is, for a message: ``line L`` of a JSON-lines file (its
    ``number``-th non-blank line), else ``row N``."""
    if _builder(path) == "json":
        with open(path, "rb") as f:
            if not f.read(4096).lstrip().startswith(b"["):
                f.seek(0)
                lines = (n for n, line in enumerate(f, 1) if line.strip())
                return f"line {next((n for i, n in enumerate(lines, 1) if i == number), number)}"
    return f"row {number}"


def text_field(value: Any, path: str, number: int, key: str) -> str:
    """``value``, row ``number``'s ``key``, when it is text; ValueError naming the file, the line and the fix
    when it is missing, null or another JSON value (a number would train as its digits)."""
    if isinstance(value, str):
        return value
    kind = "missing or null" if value is None else f"{_json_kind(value)} ({value!r})"
    quote = " (quote a number to train on its digits)" if kind.startswith("a number") else ""
    raise ValueError(f"{path!r} {row_place(path, number)}: {key!r} is {kind}, not text; give every row a text "
                     f"{key!r}{quote}")


def check_key(path: str, key: str) -> None:
    """Raise ValueError if the first row of ``path`` lacks ``key`` (txt files always have it)."""
    if _builder(path) == "text":
        return
    for row in rows(path):
        if key not in row:
            raise ValueError(
                f"key {key!r} is not in {path!r}; its rows have keys {sorted(row)}: pass --json-key with one of them"
            )
        return


def iter_documents(files: list[str], key: str = "text") -> Iterator[str]:
    """Yield the text of every document of ``files`` in order (rows whose text is empty are skipped)."""
    for path in files:
        check_key(path, key)
        for number, row in enumerate(rows(path), 1):
            text = text_field(row["text"] if _builder(path) == "text" else row.get(key), path, number, key)
            if text.strip():
                yield text


def iter_texts(source: Any, key: str = "text") -> Iterator[str]:
    """Texts of a path/glob/folder (or a list of them) or of a ``datasets`` Dataset/IterableDataset."""
    if isinstance(source, (str, os.PathLike)) or (
        isinstance(source, (list, tuple)) and all(isinstance(s, (str, os.PathLike)) for s in source)
    ):
        yield from iter_documents(resolve_files(source), key)
        return
    import datasets

    if not isinstance(source, (datasets.Dataset, datasets.IterableDataset)):
        raise TypeError(f"source must be file paths or a datasets.Dataset, got {type(source).__name__}")
    if source.column_names is not None and key not in source.column_names:
        raise ValueError(f"key {key!r} is not a column of the dataset; its columns are {source.column_names}")
    for row in source:
        if row[key].strip():
            yield row[key]


SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes: a DatasetDict's, a Dataset's
DATASET_PARTS = ("dataset_config", "dataset_split", "json_key")  # the flags that pick what --dataset reads
NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # a dataset name, "name" or "owner/name"


@dataclass(frozen=True)
class DatasetSource:
    """What ``--dataset`` reads: ``specs`` (files, globs, folders; or one ``save_to_disk`` folder; or
    one dataset name), the ``config`` and ``split`` of a name or DatasetDict folder, the text ``key``."""

    specs: tuple[str, ...]
    config: str | None = None
    split: str | None = None
    key: str = "text"

    @classmethod
    def of(cls, specs: str | os.PathLike | Iterable[str | os.PathLike]) -> DatasetSource:
        """The source of ``specs`` (one or several) with the default split, config and key."""
        items = [specs] if isinstance(specs, (str, os.PathLike)) else list(specs)
        return cls(tuple(map(str, items)))

    @property
    def kind(self) -> str:
        """"saved" (a save_to_disk folder), "name" (a dataset name, no such path here) or "files"."""
        saved = [s for s in self.specs if _is_saved(s)]
        if saved and len(self.specs) > 1:
            raise ValueError(f"--dataset {saved[0]} is a folder saved by datasets' save_to_disk: pass it alone")
        if saved:
            return "saved"
        if len(self.specs) == 1 and _is_name(self.specs[0]):
            return "name"
        return "files"

    def open(self) -> tuple[Callable[[], Iterator[str]], list[Any], str]:
        """(documents, stamp, description): a function iterating the texts; what identifies the
        content (the cache key of its tokenization: paths, sizes, mtimes; datasets' fingerprint;
        the name, config, split and key); a phrase naming it. Checked here: ValueError naming the fix."""
        kind = self.kind
        if kind != "name" and self.config is not None:
            raise ValueError(f"--dataset-config picks a configuration of a dataset name; {self.specs[0]!r} is "
                             f"{'a save_to_disk folder' if kind == 'saved' else 'files'}: drop --dataset-config")
        if kind == "files":
            if self.split is not None:
                raise ValueError(f"--dataset-split picks a split of a dataset name or a save_to_disk DatasetDict "
                                 f"folder; {self.specs[0]!r} is files: drop --dataset-split")
            from tpzoo.data.preprocess import describe_files

            files = resolve_files(self.specs)
            stamp = [(os.path.abspath(f), os.path.getsize(f), os.path.getmtime(f)) for f in files]
            return (lambda: iter_documents(files, self.key)), [stamp, self.key], describe_files(files)
        spec = self.specs[0]
        if kind == "saved":
            data, what = _load_saved(spec, self.split), f"save_to_disk folder {spec!r}"
        else:
            data, what = _load_cached(spec, self.config, self.split), f"dataset {spec!r}"
        if self.key not in data.column_names:
            raise ValueError(f"column {self.key!r} is not in {what}; its columns are {data.column_names}: "
                             "pass --json-key with one of them")
        files = [f["filename"] for f in data.cache_files]
        stamp = [kind, os.path.abspath(spec) if kind == "saved" else spec, self.config, self.split or "train",
                 self.key, data._fingerprint, [(f, os.path.getsize(f), os.path.getmtime(f)) for f in files]]
        where = ", ".join(f"{k} {v}" for k, v in (("config", self.config), ("split", data.split)) if v)
        return (lambda: _texts(data, self.key, what)), stamp, f"{what} ({where + ', ' if where else ''}" \
            f"{data.num_rows:,} rows)"


def absolute_specs(specs: Iterable[str]) -> list[str]:
    """``specs`` with paths made absolute (a checkpoint's flags name the same files from any working
    directory); a dataset name stays as it is."""
    return [s if _is_name(s) else os.path.abspath(s) for s in specs]


def _is_saved(spec: str) -> bool:
    return os.path.isdir(spec) and any(os.path.isfile(os.path.join(spec, m)) for m in SAVED_MARKERS)


def _is_name(spec: str) -> bool:
    """A dataset name: no such path here, no glob, no file suffix, and spelled like "owner/name"."""
    return (not os.path.exists(spec) and not glob.has_magic(spec) and _builder(spec) is None
            and NAME.fullmatch(spec) is not None)


def _pick(data: Any, split: str | None, what: str) -> Any:
    """The ``split`` (default "train") of a DatasetDict, or a Dataset itself (no split given)."""
    import datasets

    if isinstance(data, datasets.Dataset):
        if split is not None:
            raise ValueError(f"{what} holds one Dataset, not a DatasetDict of splits: drop --dataset-split {split}")
        return data
    split = split or "train"
    if split not in data:
        raise ValueError(f"split {split!r} is not in {what}; its splits are {', '.join(data)}: "
                         "pass --dataset-split with one of them")
    return data[split]


def _load_saved(path: str, split: str | None) -> Any:
    import datasets

    datasets.disable_progress_bars()
    return _pick(datasets.load_from_disk(path), split, f"save_to_disk folder {path!r}")


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """datasets (and the Hub client under it) in offline mode: a name resolves from the local cache only."""
    import datasets

    saved, os.environ["HF_DATASETS_OFFLINE"] = os.environ.get("HF_DATASETS_OFFLINE"), "1"
    saved_config, datasets.config.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved_config
        if saved is None:
            del os.environ["HF_DATASETS_OFFLINE"]
        else:
            os.environ["HF_DATASETS_OFFLINE"] = saved


def _load_cached(name: str, config: str | None, split: str | None) -> Any:
    """Dataset ``name`` (``config``, ``split``) from datasets' cache ($HF_DATASETS_CACHE, else
    ~/.cache/huggingface/datasets), offline; ValueError naming how to fetch it when it is not there."""
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    cache = os.environ.get("HF_DATASETS_CACHE") or datasets.config.HF_DATASETS_CACHE
    what = f"dataset {name!r}" + (f" (config {config!r})" if config else "")
    try:
        with _offline():
            data = datasets.load_dataset(name, config, cache_dir=str(cache))
    except (ConnectionError, FileNotFoundError, ValueError) as e:
        configs = re.search(r"Available configs in the cache: (\[.*\])", str(e))
        if configs:
            raise ValueError(f"{what} is not in the datasets cache {cache}; its cached configs are {configs[1]}: "
                             "pass --dataset-config with one of them") from None
        fetch = f"datasets.load_dataset({name!r}{f', {config!r}' if config else ''})"
        raise ValueError(f"--dataset {name}: no such file or folder, and {what} is not in the datasets cache {cache} "
                         f"(read offline); on a machine with a network run python -c \"import datasets; {fetch}\" "
                         "and copy its cache here (or save_to_disk a folder and pass it)") from None
    return _pick(data, split, what)


def _texts(data: Any, key: str, what: str) -> Iterator[str]:
    """The non-empty texts of column ``key`` of the Dataset ``data``, in order."""
    for batch in data.iter(batch_size=1024):
        for text in batch[key]:
            if not isinstance(text, str):
                raise ValueError(f"{what}: column {key!r} holds {type(text).__name__}, not text; pick a text column "
                                 "with --json-key")
            if text.strip():
                yield text


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    """Write ``rows`` as one JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
