"""The model cases every family-wide test runs: the only place the tests name a family.

A ``Case`` is a preset, the model class to build from it, constructor options and config
changes; ``inputs`` says what a batch for it holds ("causal-lm": ids and next-token labels;
"masked-lm": ids, token types, padding mask, MLM labels and the sentence-order label;
"classification": ids, token types, padding mask and one label per sequence). ``batch`` and
``outputs`` turn those into the keyword arguments and outputs of any case, so a test loops over
``CASES`` without knowing a family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tpzoo.models.build import build_model
from tpzoo.models.presets import get_preset


@dataclass(frozen=True)
class Case:
    preset: str
    model: str                                              # class name (tpzoo.models.build.build_model)
    inputs: str                                             # causal-lm | masked-lm | classification
    head: str                                               # num_parameters' head
    options: dict[str, Any] = field(default_factory=dict)   # constructor options
    changes: dict[str, Any] = field(default_factory=dict)   # config changes on top of the test's sizes

    def config(self, **changes: Any):
        return get_preset(self.preset, **{**self.changes, **changes})

    def build(self, config, plan, **stage):
        return build_model(self.model, config, plan, **self.options, **stage)


CASES: dict[str, Case] = {
    "gpt": Case("gpt-tiny", "GPTModel", "causal-lm", "lm"),
    "gpt-untied": Case("gpt-tiny", "GPTModel", "causal-lm", "lm", changes={"tie_word_embeddings": False}),
    "bert": Case("bert-tiny", "BertModel", "masked-lm", "pretraining", {"add_binary_head": True}),
    "bert-mlm": Case("bert-tiny", "BertModel", "masked-lm", "mlm", {"add_binary_head": False}),
    "bert-cls": Case("bert-tiny", "BertForSequenceClassification", "classification", "classification"),
    "llama": Case("llama-tiny", "LlamaModel", "causal-lm", "lm", changes={"num_query_groups": 2}),
    "llama-tied-mha": Case("llama-tiny", "LlamaModel", "causal-lm", "lm",
                           changes={"num_query_groups": None, "tie_word_embeddings": True}),
}
# one case per family and input kind: what the costlier checks (pipeline stages, recompute, engine) run
MAIN = ("gpt", "bert", "bert-cls", "llama")


def batch(case: Case, ids: torch.Tensor, generator: torch.Generator, classes: int = 3) -> dict[str, torch.Tensor]:
    """The keyword arguments of ``case``'s model for token ids [b, s]: inputs and every label key."""
    b, s = ids.shape
    if case.inputs == "causal-lm":
        return dict(input_ids=ids, labels=torch.cat([ids[:, 1:], torch.full((b, 1), -100)], 1))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[b - 1, s - max(1, s // 4):] = 0                                  # padding at the end of the last sample
    types = (torch.arange(s) >= s // 2).long().expand(b, s).clone()
    out = dict(input_ids=ids, token_type_ids=types, attention_mask=mask)
    if case.inputs == "classification":
        return dict(out, labels=torch.randint(0, classes, (b,), generator=generator))
    labels = torch.where((torch.rand(b, s, generator=generator) < 0.3) & (mask == 1), ids, -100)
    labels[0, 0] = ids[0, 0]                                              # at least one MLM target
    return dict(out, labels=labels, next_sentence_label=torch.randint(0, 2, (b,), generator=generator))


def without_labels(kwargs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in kwargs.items() if k not in ("labels", "next_sentence_label")}
