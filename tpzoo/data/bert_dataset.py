"""BERT samples: two segments of consecutive sentences, a next-sentence / sentence-order label,
and masked-language-model targets (``masked_lm_prob`` of the tokens, Megatron-LM's 15% by default; of those
80% [MASK], 10% random, 10% kept). Without a sentence task (``binary_head=None``) a sample is one segment
and carries no label for it.

Each document of the split is cut once (seeded) into chunks of whole sentences of up to
``seq_length - 3`` tokens (10% of chunks aim shorter). Epoch ``e`` visits the chunks in the order
``permutation(seed, split, e)``; sample ``i`` is built from its chunk with a generator seeded by
(seed, split, i), so it is a pure function of (data, seed, i) whoever reads it.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import torch

from tpzoo.data.gpt_dataset import check_documents, permutation, rng
from tpzoo.data.indexed import IndexedDataset
from tpzoo.data.progress import Progress, is_main_process
from tpzoo.models.config import IGNORE_INDEX


def split_chunks(
    sentence_lengths: np.ndarray,
    document_indices: np.ndarray,
    documents: Iterable[int],
    max_tokens: int,
    min_sentences: int,
    gen: np.random.Generator,
    short_seq_prob: float = 0.1,
) -> np.ndarray:
    """int64[C, 3] (first sentence, number of sentences, document): greedy chunks of whole
    sentences inside each of ``documents``, each closed once it reaches its target length
    (``max_tokens``, or with ``short_seq_prob`` a random length in [2, max_tokens]); chunks of fewer
    than ``min_sentences`` sentences are dropped."""
    chunks = []
    for d in documents:
        first, end = int(document_indices[d]), int(document_indices[d + 1])
        targets = np.where(
            gen.random(end - first) < short_seq_prob, gen.integers(2, max_tokens + 1, end - first), max_tokens
        ).tolist()
        start, total, t = first, 0, 0
        for k, length in enumerate(sentence_lengths[first:end].tolist(), first):
            total += length
            if total >= targets[t] or k == end - 1:
                if k + 1 - start >= min_sentences:
                    chunks.append((start, k + 1 - start, d))
                start, total, t = k + 1, 0, t + 1
    return np.array(chunks, dtype=np.int64).reshape(-1, 3)


class BertDataset(torch.utils.data.Dataset):
    """Map-style dataset of ``num_samples`` BERT samples, each a dict of int64 tensors:
    ``input_ids``/``token_type_ids``/``attention_mask`` (1 real, 0 pad)/``labels`` (-100 where not
    masked) of shape [s], and the scalar ``next_sentence_label`` (0: B follows A; 1: B is random
    (``"nsp"``) or the segments are swapped (``"sop"``); absent with ``binary_head=None``, which a model
    without a binary head is never handed).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: Sequence[int] | np.ndarray,
        tokenizer: Any,
        seq_length: int,
        num_samples: int,
        seed: int,
        split: int = 0,
        binary_head: str | None = "sop",
        masked_lm_prob: float = 0.15,
        whole_word_masking: bool = False,
        short_seq_prob: float = 0.1,
    ) -> None:
        if binary_head not in ("nsp", "sop", None):
            raise ValueError(f"binary_head must be 'nsp', 'sop' or None, got {binary_head!r}")
        missing = [n for n in ("cls", "sep", "mask", "pad") if getattr(tokenizer, n) is None]
        if missing:
            raise ValueError(
                f"tokenizer {tokenizer.path!r} lacks the BERT tokens {missing}; train one with "
                "`python -m tpzoo.data train-tokenizer`, which adds them"
            )
        if seq_length < 5 or num_samples < 0:
            raise ValueError(f"need seq_length >= 5 and num_samples >= 0, got {seq_length} and {num_samples}")
        self.indexed, self.tok, self.seq_length, self.num_samples = indexed, tokenizer, seq_length, num_samples
        self.seed, self.split, self.binary_head = seed, split, binary_head
        self.masked_lm_prob, self.whole_word_masking = masked_lm_prob, whole_word_masking
        self.docs = check_documents(indexed, documents, ("train", "valid", "test")[split])
        self.max_tokens = seq_length - (3 if binary_head else 2)
        name = ("train", "valid", "test")[split]
        title = f"cutting the {len(self.docs):,} {name} documents of {indexed.prefix} into BERT chunks"
        with Progress("BERT chunks", "documents", len(self.docs), title=title, enabled=is_main_process()) as bar:
            self.chunks = split_chunks(
                indexed.sequence_lengths,
                indexed.document_indices,
                bar.iterate(self.docs.tolist()),
                self.max_tokens,
                2 if binary_head else 1,
                rng(seed, split, 2),
                short_seq_prob,
            )
        if len(np.unique(self.chunks[:, 2])) < (2 if binary_head == "nsp" else 1):
            need = "two documents" if binary_head == "nsp" else "a document"
            raise ValueError(
                f"split {split} of {indexed.prefix!r} needs {need} of {2 if binary_head else 1}+ "
                "sentences; preprocess with --split-sentences or add data"
            )
        specials = np.zeros(tokenizer.vocab_size, dtype=bool)
        specials[tokenizer.special_ids] = True
        self.normal_ids = np.flatnonzero(~specials)
        self.word_start = tokenizer.word_start

    def __len__(self) -> int:
        return self.num_samples

    def _sentences(self, first: int, count: int) -> list[np.ndarray]:
        return [self.indexed.sequence(k) for k in range(first, first + count)]

    def _segments(
        self, gen: np.random.Generator, first: int, count: int, doc: int
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Segments A, B of a chunk and the binary label (B swapped in, or from another document)."""
        sents = self._sentences(first, count)
        if not self.binary_head:
            return np.concatenate(sents), np.zeros(0, np.int64), IGNORE_INDEX
        cut = int(gen.integers(1, count))
        a, b = np.concatenate(sents[:cut]), np.concatenate(sents[cut:])
        if gen.random() >= 0.5:
            return a, b, 0
        if self.binary_head == "sop":
            return b, a, 1
        while (other := self.chunks[int(gen.integers(len(self.chunks)))])[2] == doc:
            pass
        return a, np.concatenate(self._sentences(int(other[0]), int(other[1]))), 1

    def _truncate(self, gen: np.random.Generator, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Trim the longer segment, then both alike, until they fit in ``max_tokens``; the tokens
        removed from a segment come from its front or back at random."""
        if len(a) + len(b) <= self.max_tokens:
            return a, b
        short = min(len(a), len(b), self.max_tokens // 2)
        keep_a = short if len(a) <= len(b) else self.max_tokens - short
        out = []
        for seg, n in ((a, keep_a), (b, self.max_tokens - keep_a)):
            front = int(gen.binomial(len(seg) - n, 0.5))
            out.append(seg[front : front + n])
        return out[0], out[1]

    def mask(
        self, gen: np.random.Generator, tokens: np.ndarray, candidates: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mask ``round(masked_lm_prob x len)`` of ``candidates`` (positions; whole words if asked); return
        (input_ids, labels) with labels -100 off the masked positions. Rounding is stochastic so
        that rates are exact in expectation."""
        budget = max(1, int(self.masked_lm_prob * len(candidates) + gen.random()))
        if self.whole_word_masking:
            starts = self.word_start[tokens[candidates]] | (np.diff(candidates, prepend=-2) != 1)
            words = np.split(candidates, np.flatnonzero(starts)[1:])
            chosen, total = [], 0
            for w in gen.permutation(len(words)):
                if total + len(words[w]) <= budget:
                    chosen.append(words[w])
                    total += len(words[w])
            picked = gen.permutation(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)
        else:
            picked = candidates[gen.permutation(len(candidates))[:budget]]
        labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
        labels[picked] = tokens[picked]
        inputs = tokens.copy()
        u = gen.random()
        n_mask, n_keep_from = int(0.8 * len(picked) + u), int(0.9 * len(picked) + u)
        inputs[picked[:n_mask]] = self.tok.mask
        inputs[picked[n_mask:n_keep_from]] = gen.choice(self.normal_ids, n_keep_from - n_mask)
        return inputs, labels

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        epoch, r = divmod(int(i), len(self.chunks))
        first, count, doc = self.chunks[int(permutation(len(self.chunks), self.seed, self.split, 3, epoch)[r])].tolist()
        gen = rng(self.seed, self.split, 4, int(i))
        a, b, label = self._segments(gen, first, count, doc)
        a, b = self._truncate(gen, a.astype(np.int64), b.astype(np.int64))
        cls, sep, s = self.tok.cls, self.tok.sep, self.seq_length
        parts = [[cls], a, [sep]] + ([b, [sep]] if self.binary_head else [])
        tokens = np.concatenate(parts).astype(np.int64)
        n = len(tokens)
        types = np.zeros(s, dtype=np.int64)
        types[len(a) + 2 : n] = 1
        candidates = np.concatenate([np.arange(1, len(a) + 1), np.arange(len(a) + 2, n - 1)]).astype(np.int64)
        inputs, labels = self.mask(gen, tokens, candidates)
        input_ids = np.full(s, self.tok.pad, dtype=np.int64)
        input_ids[:n] = inputs
        full_labels = np.full(s, IGNORE_INDEX, dtype=np.int64)
        full_labels[:n] = labels
        attention = (np.arange(s) < n).astype(np.int64)
        sample = {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(types),
            "attention_mask": torch.from_numpy(attention),
            "labels": torch.from_numpy(full_labels),
        }
        if self.binary_head:
            sample["next_sentence_label"] = torch.tensor(label, dtype=torch.long)
        return sample
