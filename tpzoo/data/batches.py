"""Global batches of samples for the engine: a fixed size G, in a given order (pretraining reads samples
[c, c + G); fine-tuning every sample once per epoch).

    for batch in global_batches(dataset, 32, epoch_order(len(dataset), seed, epoch)):
        engine.train_step(batch)           # input_ids [32, s], labels [32] or [32, s], extras

A sample is a dict of tensors of the same shapes across the dataset (``TaskDataset``'s, whose
scalar ``label`` becomes the batch's ``labels``, or ``CausalLMDataset``'s). The last, partial
batch of an epoch is filled up with copies of its first sample whose labels are all -100
(ignored): they add nothing to a loss (summed over non-ignored labels, divided by their count),
to an accuracy or to a count, so every mesh sees the same numbers and no sample is dropped.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch import Tensor

from tpzoo.models.config import IGNORE_INDEX


def epoch_order(n: int, seed: int, epoch: int) -> Tensor:
    """A permutation of range(n), the same on every rank for (seed, epoch)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def num_batches(n: int, global_batch_size: int) -> int:
    """Batches of an epoch of ``n`` samples (the last one padded)."""
    return -(-n // global_batch_size)


def _sample(dataset: Sequence[dict[str, Tensor]], i: int) -> dict[str, Tensor]:
    sample = dict(dataset[i])
    if "label" in sample:
        sample["labels"] = sample.pop("label")
    return sample


def global_batches(dataset: Sequence[dict[str, Tensor]], global_batch_size: int, order: Tensor | None = None
                   ) -> Iterator[dict[str, Tensor]]:
    """The batches of ``dataset`` in ``order`` (default: as stored), each a dict of [G, ...] tensors
    with ``labels``; the last one padded with ignored samples (see the module docstring)."""
    if len(dataset) == 0:
        raise ValueError("the dataset holds no samples")
    order = torch.arange(len(dataset)) if order is None else order
    for start in range(0, len(order), global_batch_size):
        samples = [_sample(dataset, int(i)) for i in order[start:start + global_batch_size]]
        filler = {**samples[0], "labels": torch.full_like(samples[0]["labels"], IGNORE_INDEX)}
        samples += [filler] * (global_batch_size - len(samples))
        yield {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


class ResizableSamples(torch.utils.data.Dataset):
    """A fine-tuning dataset whose ``seq_length`` may be set again after its samples were tokenised
    (``--seq-length auto`` picks it from their ``lengths``): at least ``min_length`` (subclasses set
    both, and ``_resized`` redoes what depends on it)."""

    min_length: int
    sample_name: str = "a sample"

    @property
    def seq_length(self) -> int:
        return self._seq_length

    @seq_length.setter
    def seq_length(self, value: int) -> None:
        if value < self.min_length:
            raise ValueError(f"seq_length {value} is too short for {self.sample_name}; use {self.min_length} or more")
        self._seq_length = value
        self._resized()

    def _resized(self) -> None:
        """Called after every change of ``seq_length``."""
