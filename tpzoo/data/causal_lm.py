"""Causal-LM fine-tuning samples from text files: every document's tokens, in windows.

    dataset = CausalLMDataset(read_texts("train.jsonl"), tokenizer, seq_length=64)
    dataset[0]   # {"input_ids": [64], "labels": [64]}: labels[t] = the token after input_ids[t]

A document is its tokens followed by the end-of-document token, cut into windows of
``seq_length + 1`` tokens that overlap by one, so every next-token target of the document is
predicted exactly once; a short window is padded (ids with the pad token, labels with -100).
Labels are aligned with positions, as ``GPTModel`` takes them. ``dataset.lengths[d]``: the input
positions document d needs (its text's tokens; more than ``seq_length`` = several windows);
setting ``dataset.seq_length`` again re-cuts the windows without tokenising again.
"""

from __future__ import annotations

from typing import Any

import torch

from tpzoo.data.batches import ResizableSamples
from tpzoo.data.sources import one_file, rows, text_field
from tpzoo.models.config import IGNORE_INDEX


def read_texts(path: str, key: str = "text") -> list[str]:
    """The non-empty ``key`` fields of a jsonl/csv/tsv file, in order."""
    path = one_file(path)
    texts = []
    for number, row in enumerate(rows(path), 1):
        if key not in row:
            raise ValueError(f"{path!r} has no field {key!r} (its fields are {sorted(row)}); "
                             f"give every row a {key!r} field")
        if text_field(row[key], path, number, key).strip():
            texts.append(row[key])
    if not texts:
        raise ValueError(f"{path!r} holds no text; fill it or pick another file")
    return texts


class CausalLMDataset(ResizableSamples):
    """Samples ``{"input_ids": [s], "labels": [s]}`` (int64) of every document's windows, in order."""

    sample_name = "a causal-LM window"

    def __init__(self, texts: list[str], tokenizer: Any, seq_length: int) -> None:
        if tokenizer.eod is None:
            raise ValueError(f"tokenizer {tokenizer.path!r} has no end-of-document token")
        self.pad = tokenizer.pad if tokenizer.pad is not None else tokenizer.eod
        self.min_length = 1
        self.documents = [tokenizer.encode(text) + [tokenizer.eod] for text in texts]
        self.lengths = [len(tokens) - 1 for tokens in self.documents]
        self.seq_length = seq_length

    def _resized(self) -> None:
        """Window the documents anew: ``windows`` holds (document, first token) of every sample."""
        self.windows = [(d, i) for d, tokens in enumerate(self.documents)
                        for i in range(0, len(tokens) - 1, self.seq_length)]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        d, start = self.windows[i]
        window = self.documents[d][start:start + self.seq_length + 1]
        pad = self.seq_length + 1 - len(window)
        return {"input_ids": torch.tensor(window[:-1] + [self.pad] * pad),
                "labels": torch.tensor(window[1:] + [IGNORE_INDEX] * pad)}
