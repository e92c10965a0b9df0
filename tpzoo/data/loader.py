"""``--num-workers N`` (Megatron-LM's): the training batches are read ahead by N torch DataLoader
worker processes while the model trains on the current one.

    reader = BatchReader(train, num_workers=2, batch_size_at=batches.batch_at)
    batch = reader.read(consumed, g)   # the same tensors as global_batches(train, g, arange(consumed, consumed + g))

Batch k after a read at ``start`` is samples ``[c_k, c_k + b_k)`` with ``c_0 = start``,
``b_k = batch_size_at(c_k)`` and ``c_{k+1} = c_k + b_k``: the loop's sequence of consumed samples, so
the workers read ahead exactly what the loop asks next (in order; up to 2 batches per worker). A
read off that sequence (another start or size) starts the workers again from it. Samples depend
on their index only, so any worker count gives the same batches.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from tpzoo.data.batches import global_batches


def _plan(start: int, batch_size_at: Callable[[int], int]) -> Iterator[list[int]]:
    """The index lists of the batches from sample ``start`` on (endless)."""
    while True:
        size = batch_size_at(start)
        yield list(range(start, start + size))
        start += size


class _Plan:
    """A DataLoader ``batch_sampler``: ``_plan(start, batch_size_at)``."""

    def __init__(self, start: int, batch_size_at: Callable[[int], int]) -> None:
        self.start, self.batch_size_at = start, batch_size_at

    def __iter__(self) -> Iterator[list[int]]:
        return _plan(self.start, self.batch_size_at)


def _collate(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return next(global_batches(samples, len(samples)))


class BatchReader:
    """Reads the global batches of ``dataset`` (map-style, samples depending only on their index)
    in ``num_workers`` DataLoader worker processes, ahead of the training loop (module docstring)."""

    def __init__(self, dataset: Any, num_workers: int, batch_size_at: Callable[[int], int]) -> None:
        if num_workers < 1:
            raise ValueError(f"a BatchReader needs num_workers >= 1, got {num_workers}")
        self.dataset, self.num_workers, self.batch_size_at = dataset, num_workers, batch_size_at
        self._batches: Iterator[dict[str, Tensor]] | None = None
        self._expected: Iterator[list[int]] | None = None
        self._next: tuple[int, int] | None = None

    def _start(self, start: int) -> None:
        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=_Plan(start, self.batch_size_at),
                                             num_workers=self.num_workers, collate_fn=_collate,
                                             generator=torch.Generator())  # leaves the training RNG (dropout) alone
        self._batches, self._expected = iter(loader), _plan(start, self.batch_size_at)

    def read(self, start: int, size: int) -> dict[str, Tensor]:
        """Samples ``[start, start + size)`` as one batch (a dict of [size, ...] tensors)."""
        if self._next != (start, size):
            self._start(start)
            self._next = (start, size)
        indices = next(self._expected)
        if (indices[0], len(indices)) != (start, size):  # batch_size_at(start) is not this size
            raise ValueError(f"read({start}, {size}) but the batch schedule gives {len(indices)} samples at {start}")
        batch = next(self._batches)
        self._next = (start + size, self.batch_size_at(start + size))
        return batch

    def close(self) -> None:
        """Stop the worker processes."""
        self._batches = self._expected = self._next = None
