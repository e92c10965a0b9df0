"""The named fine-tuning tasks: GLUE's (CoLA, SST-2, MRPC, QQP, MNLI, QNLI, RTE), as GLUE distributes
their files, and the bundled demo. Plain data, no torch: ``finetune.py`` checks ``--task`` with it
before loading anything heavy; ``tpzoo.data.tasks`` reads the files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GlueLayout:
    train: str
    valid: str
    text: str
    text_b: str | None
    label: str
    labels: tuple[str, ...]
    column_names: tuple[str, ...] | None = None  # for files without a header row


_BINARY = ("0", "1")
_NLI = ("entailment", "not_entailment")
GLUE = {
    "cola": GlueLayout(
        "train.tsv", "dev.tsv", "sentence", None, "label", _BINARY, ("source", "label", "original_label", "sentence")
    ),
    "sst-2": GlueLayout("train.tsv", "dev.tsv", "sentence", None, "label", _BINARY),
    "mrpc": GlueLayout("train.tsv", "dev.tsv", "#1 String", "#2 String", "Quality", _BINARY),
    "qqp": GlueLayout("train.tsv", "dev.tsv", "question1", "question2", "is_duplicate", _BINARY),
    "mnli": GlueLayout(
        "train.tsv",
        "dev_matched.tsv",
        "sentence1",
        "sentence2",
        "gold_label",
        ("contradiction", "entailment", "neutral"),
    ),
    "qnli": GlueLayout("train.tsv", "dev.tsv", "question", "sentence", "label", _NLI),
    "rte": GlueLayout("train.tsv", "dev.tsv", "sentence1", "sentence2", "label", _NLI),
}
TASKS = ("demo", *GLUE)
