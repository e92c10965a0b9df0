"""GPT samples: contiguous windows over the documents of a split, shuffled by seed.

Epoch ``e`` lists the split's documents in the order ``permutation(seed, split, e)``; epochs are
concatenated into one token stream (documents end with the end-of-document id when preprocessed
with ``--append-eod``). Window ``j`` is stream tokens ``[j*s, j*s + s + 1)``. Windows are shuffled
inside blocks of ``tokens_per_epoch // s`` windows, each by its own seeded permutation, so sample
``i`` depends only on (data, split, seq_length, seed, i): not on the number of samples asked for,
the rank that reads it or the order of reading.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from tpzoo.data.documents import DocumentMarks
from tpzoo.data.indexed import IndexedDataset
from tpzoo.data.progress import Progress, is_main_process
from tpzoo.machine import check_index_fits


def rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator that depends only on ``seed`` and ``keys`` (non-negative ints)."""
    return np.random.default_rng([seed, *keys])


@lru_cache(maxsize=8)
def permutation(n: int, seed: int, *keys: int) -> np.ndarray:
    """int64[n], a permutation of ``range(n)`` fixed by ``seed`` and ``keys`` (cached)."""
    perm = rng(seed, *keys).permutation(n)
    perm.flags.writeable = False
    return perm


def check_documents(indexed: IndexedDataset, documents: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    """``documents`` as int64, or ValueError if the split is empty or out of range."""
    docs = np.asarray(documents, dtype=np.int64)
    if not len(docs):
        raise ValueError(f"the {name} split of {indexed.prefix!r} has no documents; change --split or add data")
    if docs.min() < 0 or docs.max() >= indexed.num_documents:
        raise ValueError(f"document ids must lie in [0, {indexed.num_documents}), got {docs.min()}..{docs.max()}")
    return docs


class GPTDataset(torch.utils.data.Dataset):
    """Map-style dataset of ``num_samples`` samples ``{"input_ids": int64[s], "labels": int64[s]}``
    where ``labels`` are the next tokens (each window reads s+1 tokens).

    ``split`` (0 train, 1 valid, 2 test) keeps the splits' shuffles apart. ``marks``: what each sample also says
    of the documents packed in it (``tpzoo.data.documents``: ``document_ids``, ``position_ids``, masked labels).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: Sequence[int] | np.ndarray,
        seq_length: int,
        num_samples: int,
        seed: int,
        split: int = 0,
        marks: DocumentMarks | None = None,
    ) -> None:
        if seq_length < 1 or num_samples < 0:
            raise ValueError(f"need seq_length >= 1 and num_samples >= 0, got {seq_length} and {num_samples}")
        self.indexed, self.seq_length, self.num_samples, self.seed, self.split = (
            indexed,
            seq_length,
            num_samples,
            seed,
            split,
        )
        self.marks = marks if marks is not None and marks.active else None
        name = ("train", "valid", "test")[split]
        docs = check_documents(indexed, documents, name)
        lengths = indexed.document_lengths
        tokens_per_epoch = int(lengths[docs].sum())
        if tokens_per_epoch == 0:
            raise ValueError(f"the documents of split {split} of {indexed.prefix!r} hold no tokens")
        self.block = max(1, tokens_per_epoch // seq_length)
        windows = -(-num_samples // self.block) * self.block
        self.epochs = max(1, -(-(windows * seq_length + 1) // tokens_per_epoch))
        check_index_fits(16 * self.epochs * len(docs), f"{num_samples:,} {name} samples of {seq_length} tokens "
                         f"({self.epochs:,} epochs of {len(docs):,} documents)")
        title = (
            f"ordering the {name} documents of {indexed.prefix} for {num_samples:,} samples of {seq_length} tokens: "
            f"{self.epochs:,} epochs of {len(docs):,} documents"
        )
        with Progress("GPT epochs", "epochs", self.epochs, title=title, enabled=is_main_process()) as bar:
            order = [docs[permutation(len(docs), seed, split, 0, e)] for e in bar.iterate(range(self.epochs))]
        self.doc_order = np.concatenate(order)
        self.doc_ends = np.cumsum(lengths[self.doc_order])

    def __len__(self) -> int:
        return self.num_samples

    def window(self, j: int) -> np.ndarray:
        """int64[s+1]: tokens ``[j*s, j*s+s+1)`` of the stream (window ``j`` before shuffling)."""
        start, need = j * self.seq_length, self.seq_length + 1
        k = int(np.searchsorted(self.doc_ends, start, side="right"))
        offset = start - (int(self.doc_ends[k - 1]) if k else 0)
        pieces = []
        while need:
            piece = self.indexed.document(int(self.doc_order[k]))[offset : offset + need]
            pieces.append(piece)
            need -= len(piece)
            k, offset = k + 1, 0
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        block, r = divmod(int(i), self.block)
        tokens = torch.from_numpy(
            self.window(block * self.block + int(permutation(self.block, self.seed, self.split, 1, block)[r]))
        )
        sample = {"input_ids": tokens[:-1], "labels": tokens[1:]}
        return sample if self.marks is None else self.marks(sample)
