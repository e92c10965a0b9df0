"""Fine-tuning tasks: csv/tsv/jsonl files with ``text``, optional ``text_b`` and ``label`` columns,
GLUE folders (CoLA, SST-2, MRPC, QQP, MNLI, QNLI, RTE as GLUE distributes them), and the bundled
demo sentiment task; ``TaskDataset`` turns examples into padded classifier inputs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tpzoo.data.batches import ResizableSamples
from tpzoo.data.glue import GLUE, TASKS
from tpzoo.data.sources import one_file, row_place, rows, text_field


@dataclass(frozen=True)
class Example:
    text: str
    text_b: str | None
    label: int


def _label_text(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _label_kind(value: Any) -> str:
    """"boolean" (true/false, in any case), "number" or "name": a file's labels are of one kind."""
    if isinstance(value, bool) or str(value).strip().lower() in ("true", "false"):
        return "boolean"
    return "number" if isinstance(value, (int, float)) or re.fullmatch(r"[+-]?\d+(\.\d*)?", str(value)) else "name"


def label_order(labels: set[str]) -> list[str]:
    """Label names in class-id order: integers numerically (``2`` before ``10``), else sorted as strings."""
    if all(re.fullmatch(r"[+-]?\d+", y) for y in labels):
        return sorted(labels, key=lambda y: (int(y), y))
    return sorted(labels)


class UnknownLabels(ValueError):
    """A file's labels outside the label names it was read with (``path``, ``unknown``, ``known``)."""

    def __init__(self, path: str, unknown: list[str], known: list[str]) -> None:
        super().__init__(f"{path!r} has labels {unknown} outside the known labels {known}; fix the file")
        self.path, self.unknown, self.known = path, unknown, known


def read_examples(
    path: str,
    label_names: Sequence[str] | None = None,
    text: str = "text",
    text_b: str | None = "text_b",
    label: str = "label",
    **options: Any,
) -> tuple[list[Example], list[str]]:
    """Read a csv/tsv/jsonl file of examples; returns (examples, label names in id order).

    Labels map to ids through ``label_names`` when given (pass the training file's names when
    reading its validation file; a label outside them raises ``UnknownLabels``); else the K labels
    found become ids ``0..K-1`` in ``label_order`` (integers numerically: labels 1 2 3 5 7 8 are
    6 classes). ``text_b`` is optional per file.
    """
    path = one_file(path)
    raw, kinds = [], {}
    for number, row in enumerate(rows(path, **options), 1):
        missing = [k for k in (text, label) if k not in row]
        if missing:
            raise ValueError(
                f"{path!r} has no column {missing[0]!r} (its columns are {sorted(row)}); "
                f"rename the column or pick another"
            )
        if row[label] is None or row[label] == "":
            raise ValueError(f"{path!r} {row_place(path, number)} has no {label!r} (null or empty); give every row a "
                             f"label")
        second = None if row.get(text_b) in (None, "") else text_field(row[text_b], path, number, text_b)
        raw.append((text_field(row[text], path, number, text), second, _label_text(row[label])))
        kinds.setdefault(_label_kind(row[label]), (number, row[label]))
    if not raw:
        raise ValueError(f"{path!r} holds no examples; fill it or pick another file")
    if not any(a.strip() for a, *_ in raw):
        raise ValueError(f"{path!r} holds no text: every row's {text!r} is empty; fill it or pick another file")
    if "boolean" in kinds and len(kinds) > 1:  # true and 1 would be two classes
        (n1, v1), (n2, v2) = kinds.pop("boolean"), next(iter(kinds.values()))
        raise ValueError(f"{path!r} mixes label kinds: {row_place(path, n1)} has {v1!r}, {row_place(path, n2)} "
                         f"{v2!r}; write every label one way (all true/false, or none)")
    if label_names is None:
        label_names = label_order({y for *_, y in raw})
    ids = {name: i for i, name in enumerate(label_names)}
    unknown = label_order({y for *_, y in raw if y not in ids})
    if unknown:
        raise UnknownLabels(path, unknown, list(label_names))
    return [Example(a, b, ids[y]) for a, b, y in raw], list(label_names)


def load_task(name: str, split: str = "train", folder: str | None = None) -> tuple[list[Example], list[str]]:
    """Examples of a named task: ``demo`` (bundled sentiment) or a GLUE task read from ``folder``
    (GLUE's files, e.g. ``glue_data/SST-2``). ``split`` is ``train`` or ``valid`` (GLUE's dev)."""
    key = name.lower().replace("sst2", "sst-2")
    if key not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)} or pass data files")
    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
    if key == "demo":
        from tpzoo.data.demo import demo_task

        return read_examples(demo_task()[split == "valid"], ["0", "1"])
    if folder is None:
        raise ValueError(f"task {name!r} needs the folder holding its GLUE files (train.tsv, dev.tsv)")
    layout = GLUE[key]
    path = os.path.join(folder, layout.train if split == "train" else layout.valid)
    options = {"header": None, "column_names": list(layout.column_names)} if layout.column_names else {}
    return read_examples(path, layout.labels, layout.text, layout.text_b, layout.label, **options)


def padding_token(tokenizer: Any) -> int | None:
    """The id classifier samples are padded with: the tokenizer's pad token, else its separator, else its end of
    document (a GPT-2 tokenizer's); None when it has none of them."""
    return next((i for i in (tokenizer.pad, tokenizer.sep, tokenizer.eod) if i is not None), None)


class TaskDataset(ResizableSamples):
    """Map-style dataset of classifier samples, each a dict of int64 tensors: ``input_ids``,
    ``token_type_ids`` (with ``token_types``: for a model that reads segments, BERT), ``attention_mask``
    (1 real, 0 pad) of shape [s] and the scalar ``label``.

    Layout ``[CLS] A [SEP] B [SEP]`` then padding; a tokenizer without [CLS]/[SEP] (GPT-2's) uses
    no CLS and its end-of-document token as the separator. The longer text is trimmed first.
    ``lengths[i]``: the tokens sample i takes uncut (its layout's); ``seq_length`` may be set
    again later (``--seq-length auto`` picks it from ``lengths``), at least ``min_length``.
    """

    sample_name = "a task sample"

    def __init__(self, examples: Sequence[Example], tokenizer: Any, seq_length: int, token_types: bool = True) -> None:
        sep = tokenizer.sep if tokenizer.sep is not None else tokenizer.eod
        if sep is None:
            raise ValueError(f"tokenizer {tokenizer.path!r} has neither [SEP] nor an end-of-document token")
        self.cls = [] if tokenizer.cls is None else [tokenizer.cls]
        self.sep, self.pad = sep, padding_token(tokenizer)
        self.min_length = len(self.cls) + 4  # [CLS] a [SEP] b [SEP]: one token of each text
        self.seq_length, self.token_types = seq_length, token_types
        self.examples = list(examples)
        self.encoded = [
            (tokenizer.encode(e.text), None if e.text_b is None else tokenizer.encode(e.text_b)) for e in self.examples
        ]
        self.lengths = [len(self.cls) + len(a) + 1 + (0 if b is None else len(b) + 1) for a, b in self.encoded]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a, b = (list(x) if x is not None else None for x in self.encoded[i])
        room = self.seq_length - len(self.cls) - (1 if b is None else 2)
        while len(a) + len(b or []) > room:
            (a if b is None or len(a) >= len(b) else b).pop()
        ids = self.cls + a + [self.sep]
        types = [0] * len(ids)
        if b is not None:
            ids += b + [self.sep]
            types += [1] * (len(b) + 1)
        n, pad = len(ids), self.seq_length - len(ids)
        sample = {"input_ids": torch.tensor(ids + [self.pad] * pad),
                  "attention_mask": torch.tensor([1] * n + [0] * pad), "label": torch.tensor(self.examples[i].label)}
        if self.token_types:
            sample["token_type_ids"] = torch.tensor(types + [0] * pad)
        return sample
