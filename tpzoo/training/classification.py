"""Validation metrics of a sequence classifier from its logits: loss, accuracy, and F1 for two classes.

    classification_metrics(logits, labels)   # logits [N, K], labels [N] (-100 = padding, skipped)
    -> {"val_loss": ..., "accuracy": ..., "f1": ...}     # f1 only when K == 2 (class 1 positive)
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from tpzoo.models.config import IGNORE_INDEX


def f1_score(predictions: Tensor, labels: Tensor, positive: int = 1) -> float:
    """F1 of class ``positive`` (2 TP / (2 TP + FP + FN)); 0 when there is no positive at all."""
    tp = ((predictions == positive) & (labels == positive)).sum().item()
    fp = ((predictions == positive) & (labels != positive)).sum().item()
    fn = ((predictions != positive) & (labels == positive)).sum().item()
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def classification_metrics(logits: Tensor, labels: Tensor) -> dict[str, float]:
    """Mean cross-entropy ``val_loss``, ``accuracy`` and (two classes) ``f1`` over the non-ignored
    rows of logits [N, K] (float) and labels [N]."""
    keep = labels != IGNORE_INDEX
    if not keep.any():
        raise ValueError("no labelled examples to score")
    logits, labels = logits[keep].float(), labels[keep]
    predictions = logits.argmax(-1)
    metrics = {"val_loss": F.cross_entropy(logits, labels).item(),
               "accuracy": (predictions == labels).float().mean().item()}
    if logits.shape[-1] == 2:
        metrics["f1"] = f1_score(predictions, labels)
    return metrics
