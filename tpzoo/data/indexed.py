"""Memory-mapped indexed datasets: ``PREFIX.bin`` (token ids) + ``PREFIX.idx`` (boundaries).

The layout is Megatron-LM's ``MMIDIDX`` version 1, so either project reads the other's files:

    PREFIX.bin  the token ids of every sequence, back to back, as one integer dtype
    PREFIX.idx  b"MMIDIDX\\x00\\x00", <Q version=1, <B dtype code, <Q sequence count S,
                <Q document-index count D+1, int32[S] sequence lengths, int64[S] byte offsets
                into .bin, int64[D+1] document indices (document d is sequences
                doc_idx[d] .. doc_idx[d+1]-1; doc_idx[0] = 0)

A sequence is a sentence when preprocessing split sentences (BERT), else a whole document (GPT).
tpzoo appends a JSON metadata block (tokenizer reference, options) after those arrays, followed by
its <Q byte length and b"TPZOOMD1"; Megatron ignores trailing bytes.
"""

from __future__ import annotations

import json
import os
import struct
from array import array
from functools import cached_property
from typing import Any, Sequence

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_META_MAGIC = b"TPZOOMD1"
_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def token_dtype(vocab_size: int) -> type[np.integer]:
    """The smallest unsigned/signed integer dtype that holds ids ``0 .. vocab_size-1``."""
    for dtype in (np.uint8, np.uint16, np.int32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return dtype
    return np.int64


def paths(prefix: str) -> tuple[str, str]:
    """``(PREFIX.bin, PREFIX.idx)``."""
    return prefix + ".bin", prefix + ".idx"


class IndexedDatasetBuilder:
    """Stream documents into ``PREFIX.bin``/``PREFIX.idx``; the files appear whole at ``finalize``.

    Use as a context manager: an exception inside the block removes the partial files.
    """

    def __init__(self, prefix: str, vocab_size: int) -> None:
        self.prefix, self.vocab_size = prefix, vocab_size
        self.dtype = np.dtype(token_dtype(vocab_size))
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(paths(prefix)[0] + ".tmp", "wb")
        self._lengths = array("i")
        self._doc_idx = array("q", [0])
        self.num_tokens = 0

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    def add_document(self, tokens: Sequence[int] | np.ndarray, sentence_lengths: Sequence[int] | None = None) -> None:
        """Append one document; ``sentence_lengths`` (summing to ``len(tokens)``) splits it into
        sentences, else it is one sequence. Zero-length sentences are dropped; an empty document is skipped."""
        tokens = np.asarray(tokens)
        lengths = [len(tokens)] if sentence_lengths is None else [int(n) for n in sentence_lengths if n > 0]
        if sum(lengths) != len(tokens):
            raise ValueError(f"sentence lengths sum to {sum(lengths)} but the document has {len(tokens)} tokens")
        if not len(tokens):
            return
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got {tokens.min()}..{tokens.max()}")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.extend(lengths)
        self._doc_idx.append(len(self._lengths))
        self.num_tokens += len(tokens)

    def finalize(self, metadata: dict[str, Any] | None = None) -> None:
        """Write ``PREFIX.idx`` (with ``metadata`` as its JSON block) and move both files in place."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=pointers[1:])
        pointers *= self.dtype.itemsize
        code = next(c for c, t in _CODES.items() if np.dtype(t) == self.dtype)
        meta = json.dumps(metadata or {}, sort_keys=True).encode()
        bin_path, idx_path = paths(self.prefix)
        with open(idx_path + ".tmp", "wb") as f:
            f.write(_MAGIC + struct.pack("<QBQQ", 1, code, len(lengths), len(self._doc_idx)))
            f.write(lengths.tobytes() + pointers.tobytes() + np.frombuffer(self._doc_idx, dtype=np.int64).tobytes())
            f.write(meta + struct.pack("<Q", len(meta)) + _META_MAGIC)
        os.replace(bin_path + ".tmp", bin_path)
        os.replace(idx_path + ".tmp", idx_path)

    def discard(self) -> None:
        """Close and delete the partial files."""
        self._bin.close()
        for path in paths(self.prefix):
            if os.path.exists(path + ".tmp"):
                os.remove(path + ".tmp")

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.discard()


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin``/``PREFIX.idx`` (constant memory at any size).

    ``sequence_lengths`` int32[S], ``sequence_pointers`` int64[S] (bytes), ``document_indices``
    int64[D+1]; ``sequence(i)`` / ``document(d)`` return read-only numpy views of token ids.
    Pickles as its prefix, so DataLoader workers re-open the files.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = str(prefix)
        bin_path, idx_path = paths(self.prefix)
        missing = [p for p in (bin_path, idx_path) if not os.path.isfile(p)]
        if missing and os.path.isdir(self.prefix):
            inside = sorted(f.removesuffix(".idx") for f in os.listdir(self.prefix) if f.endswith(".idx"))
            hint = f", e.g. {os.path.join(self.prefix, inside[0])}" if inside else " (it holds no .idx file)"
            raise FileNotFoundError(f"indexed dataset prefix {self.prefix!r} is a folder; pass the PREFIX of the "
                                    f"PREFIX.bin and PREFIX.idx in it{hint}")
        if missing:
            raise FileNotFoundError(
                f"indexed dataset {' and '.join(missing)} not found; run "
                "`python -m tpzoo.data preprocess` to make it, or fix --data-path"
            )
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        if bytes(self._idx[:9]) != _MAGIC or len(self._idx) < 34:
            raise ValueError(f"{idx_path!r} is not an indexed dataset index (bad header); re-run preprocessing")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", bytes(self._idx[9:34]))
        if version != 1 or code not in _CODES:
            raise ValueError(f"{idx_path!r} has unsupported version {version} or dtype code {code}")
        self.dtype = np.dtype(_CODES[code])
        buf, off = self._idx, 34
        if len(buf) < off + 12 * n_seq + 8 * n_doc:
            raise ValueError(
                f"{idx_path!r} is cut short: {len(buf)} bytes, but its {n_seq} sequences and {n_doc} document "
                f"indices need {off + 12 * n_seq + 8 * n_doc}; re-run preprocessing"
            )
        self.sequence_lengths = np.frombuffer(buf, np.int32, n_seq, off)
        self.sequence_pointers = np.frombuffer(buf, np.int64, n_seq, off + 4 * n_seq)
        self.document_indices = np.frombuffer(buf, np.int64, n_doc, off + 12 * n_seq)
        self.metadata = self._read_metadata(off + 12 * n_seq + 8 * n_doc)
        self._check_bin_size(bin_path, idx_path)
        self._bin = (
            np.memmap(bin_path, mode="r", dtype=self.dtype) if os.path.getsize(bin_path) else np.empty(0, self.dtype)
        )

    def _check_bin_size(self, bin_path: str, idx_path: str) -> None:
        """ValueError naming both sizes unless ``.bin`` holds exactly the bytes the index points into."""
        n = self.num_sequences
        needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
        size = os.path.getsize(bin_path)
        if size != needed:
            raise ValueError(
                f"{bin_path!r} holds {size} bytes but {idx_path!r} indexes {needed}: the .bin is "
                f"{'cut short' if size < needed else 'longer'} or from another run; re-run preprocessing"
            )

    def _read_metadata(self, end: int) -> dict[str, Any]:
        tail = bytes(self._idx[-16:])
        if len(self._idx) < end + 16 or tail[8:] != _META_MAGIC:
            return {}
        size = struct.unpack("<Q", tail[:8])[0]
        return json.loads(bytes(self._idx[-16 - size : -16]))

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self._bin)

    def __len__(self) -> int:
        return self.num_sequences

    @property
    def tokens(self) -> np.ndarray:
        """Every token id, in file order: a read-only memory map."""
        return self._bin

    @cached_property
    def document_lengths(self) -> np.ndarray:
        """int64[D]: tokens per document (from the offsets of its first and last sequences)."""
        first, end = self.document_indices[:-1], self.document_indices[1:]
        last = np.maximum(end - 1, 0)
        stop = self.sequence_pointers[last] // self.dtype.itemsize + self.sequence_lengths[last]
        start = self.sequence_pointers[np.minimum(first, max(self.num_sequences - 1, 0))] // self.dtype.itemsize
        return np.where(end > first, stop - start, 0)

    def sequence(self, i: int) -> np.ndarray:
        """Tokens of sequence (sentence or document) ``i``: a read-only view, ``self.dtype``."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self._bin[start : start + int(self.sequence_lengths[i])]

    def document(self, d: int) -> np.ndarray:
        """Tokens of document ``d`` (its sequences are contiguous in ``.bin``): a read-only view."""
        first, end = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if first == end:
            return self._bin[:0]
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        return self._bin[start : start + int(self.sequence_lengths[first:end].sum())]

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise ValueError unless ``tokenizer`` is the one this dataset was preprocessed with
        (datasets made elsewhere, without tpzoo's metadata, are not checked)."""
        ref = self.metadata.get("tokenizer")
        if ref and ref["sha256"] != tokenizer.sha256:
            raise ValueError(
                f"dataset {self.prefix!r} was tokenized with {ref['path']!r} (sha256 {ref['sha256'][:12]}, "
                f"vocab {ref['vocab_size']}) but the tokenizer given is {tokenizer.path!r} (sha256 "
                f"{tokenizer.sha256[:12]}, vocab {tokenizer.vocab_size}); pass the matching --tokenizer-model "
                "or re-run preprocessing with this one"
            )

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, documents={self.num_documents}, "
            f"sequences={self.num_sequences}, tokens={self.num_tokens}, dtype={self.dtype})"
        )
