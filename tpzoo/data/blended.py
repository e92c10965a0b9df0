"""Megatron-LM's blended datasets (``--data-path W1 PREFIX1 W2 PREFIX2 ...``): sample i of a blend
of K datasets with weights w (normalized to sum 1) is sample ``sample_index[i]`` of dataset
``dataset_index[i]``, where dataset_index[i] is the dataset furthest behind its share:

    j = argmax_k ( w_k * max(i, 1) - taken_k )      (the first such k on a tie)
    dataset_index[i] = j;  sample_index[i] = taken_j;  taken_j += 1

so every prefix of the blend follows the weights as closely as whole samples can, the same on every
rank and run. A blend of N samples asks dataset k for ``ceil(ceil(N * w_k) * 1.005)`` samples
(Megatron-LM's default surplus), more than the greedy order ever takes. The order is computed in
Python when the datasets are built: about 1.3 s per million samples (Megatron-LM's is C++).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from tpzoo.machine import check_index_fits

SURPLUS = 0.005


def normalized(weights: Sequence[float]) -> list[float]:
    """``weights`` / their sum; ValueError unless every weight is > 0."""
    if not weights or min(weights) <= 0:
        raise ValueError(f"blend weights must all be > 0, got {list(weights)}")
    total = float(sum(weights))
    return [w / total for w in weights]


def blend_sizes(weights: Sequence[float], size: int) -> list[int]:
    """Samples to build of each dataset for a blend of ``size`` samples (normalized ``weights``)."""
    return [int(math.ceil(math.ceil(size * w) * (1 + SURPLUS))) for w in weights]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int64[size], sample_index int64[size]) of the greedy order (module docstring)."""
    check_index_fits(16 * size, f"{size:,} samples of a blend")
    dataset_index = np.empty(size, dtype=np.int64)
    sample_index = np.empty(size, dtype=np.int64)
    taken = [0] * len(weights)
    for i in range(size):
        scale = max(i, 1)
        errors = [w * scale - t for w, t in zip(weights, taken)]
        j = errors.index(max(errors))
        dataset_index[i], sample_index[i] = j, taken[j]
        taken[j] += 1
    return dataset_index, sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` by ``weights`` (normalized) in the greedy order."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: int) -> None:
        self.datasets, self.weights = list(datasets), normalized(weights)
        self.dataset_index, self.sample_index = blending_indices(self.weights, size)
        for k, dataset in enumerate(self.datasets):
            taken = int((self.dataset_index == k).sum())
            if taken > len(dataset):
                raise ValueError(f"blend dataset {k} holds {len(dataset)} samples but the blend of {size} takes "
                                 f"{taken}; build it with blend_sizes")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> Any:
        return self.datasets[self.dataset_index[i]][int(self.sample_index[i])]
