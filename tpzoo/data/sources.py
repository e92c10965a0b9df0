"""Read documents (strings) from local json/jsonl/txt/parquet/csv files through ``datasets``.

Files are streamed (``streaming=True``), so reading is constant-memory whatever the corpus size.
A ``.txt`` file holds one document per paragraph (documents are separated by blank lines, one
sentence or line per line inside, the layout BERT's original pretraining data used); json/jsonl
/parquet/csv files hold one document per row under a chosen key.
"""

from __future__ import annotations

import csv
import glob
import json
import os
from typing import Any, Iterable, Iterator

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
        if head.startswith(b"["):  # one JSON document, not JSON lines
            try:
                json.loads(f.read())
            except UnicodeDecodeError as e:
                return f"byte {e.start} is not UTF-8 (a binary file?)"
            except ValueError as e:
                return f"line {e.lineno}, column {e.colno}: {e.msg.removesuffix(' at')}"
            return None
        for number, line in enumerate(f, 1):
            try:
                if line.strip():
                    json.loads(line)
            except UnicodeDecodeError:
                return f"line {number} is not UTF-8 text (a binary file?)"
            except ValueError as e:
                return f"line {number}, column {e.colno}: {e.msg.removesuffix(' at')}"
    return None


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
        for row in rows(path):
            text = row["text"] if _builder(path) == "text" else row.get(key)
            if not isinstance(text, str):
                raise ValueError(f"{path!r}: key {key!r} holds {type(text).__name__}, not text; pick a text field")
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
