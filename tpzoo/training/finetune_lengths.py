"""Sample lengths against ``--seq-length``: the report ``finetune.py`` prints once before training, and
``--seq-length auto``.

    lengths = train.lengths                                  # tokens each sample takes uncut
    seq = auto_seq_length(lengths, cap=512, minimum=6)       # the 95th percentile, within [minimum, cap]
    length_report("training samples", lengths, seq, "are cut")
    # 'training samples: 2000, tokens p50 14 / p95 24 / max 41; 12 (0.6%) longer than --seq-length 24 are cut'

Percentiles are nearest-rank: ``percentile(lengths, q)`` is the smallest length that at least q% of
the samples do not exceed, so ``--seq-length auto`` leaves at most 5% of the training samples cut.
"""

from __future__ import annotations

import math
from typing import Sequence

AUTO = "auto"
AUTO_PERCENTILE = 95


def percentile(lengths: Sequence[int], q: float) -> int:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``lengths`` (not empty)."""
    ordered = sorted(lengths)
    return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1]


def auto_seq_length(lengths: Sequence[int], cap: int, minimum: int = 1, multiple: int = 1) -> int:
    """``AUTO_PERCENTILE``-th percentile of ``lengths``, at least ``minimum``, rounded up to a multiple
    of ``multiple`` (tp under sequence parallelism), and at most ``cap`` (max_position_embeddings,
    rounded down to that multiple)."""
    pick = -(-max(percentile(lengths, AUTO_PERCENTILE), minimum) // multiple) * multiple
    return min(pick, cap // multiple * multiple)


def length_report(name: str, lengths: Sequence[int], seq_length: int, cut: str) -> str:
    """One line: how many of ``lengths`` exceed ``seq_length`` (and then ``cut``: what happens to them),
    with the p50 / p95 / max token lengths."""
    over = sum(n > seq_length for n in lengths)
    return (f"{name}: {len(lengths)}, tokens p50 {percentile(lengths, 50)} / p95 {percentile(lengths, 95)} / "
            f"max {max(lengths)}; {over} ({over / len(lengths):.1%}) longer than --seq-length {seq_length} {cut}")
