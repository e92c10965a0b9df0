"""finetune.py's own flags as the run configuration's ``FinetuneConfig`` section (the "fine-tuning" group): what to
fine-tune (``--load``, ``--model`` for a family from outside tpzoo), on what data (``--task`` or
``--train-data/--valid-data``, ``--tokenizer-model``), for how long and how long its samples are (``--epochs``,
``--seq-length`` N or auto), the dropout it trains with, where it writes. Imports without torch.

    add_section(parser, FinetuneConfig, "fine-tuning")
    tune = section_of(FinetuneConfig, vars(args))
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from tpzoo.data.glue import TASKS
from tpzoo.fields import at_least, check_fields, fraction, one_of, option, optional, parses, string
from tpzoo.flag_types import positive_int
from tpzoo.models.family_flag import OUTSIDE, family_name
from tpzoo.training.finetune_lengths import AUTO


def seq_length_flag(text: str) -> int | str:
    """argparse type of ``--seq-length``: an integer >= 1 or ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}") from None


@parses(seq_length_flag)
def _seq_length(v: Any) -> str | None:
    ok = v == AUTO or type(v) is int and v >= 1
    return None if ok else f"must be an integer >= 1 or 'auto', got {v!r}"


def _path(doc: str, flag: str, metavar: str) -> Any:
    return option(None, optional(string), doc, flag, metavar)


@dataclass(frozen=True)
class FinetuneConfig:
    """What finetune.py fine-tunes, on what, for how long, and where it writes (docs/finetuning.md)."""

    load: str | None = _path("pretrained checkpoint (pretrain.py's --save dir or an iter folder) or tpzoo model folder "
                             "(python -m tpzoo.convert from-hf); required", "--load", "CKPT")
    model: str | None = option(None, optional(family_name), OUTSIDE, "--model", "MODULE:NAME")
    task: str | None = option(None, optional(one_of(*TASKS)), "a named classification task (GLUE ones read "
                              "--data-dir)", "--task")
    data_dir: str | None = _path("the GLUE task's folder (train.tsv, dev.tsv)", "--data-dir", "DIR")
    train_data: str | None = _path("csv/tsv/jsonl: text (+ text_b) and label: a classifier; prompt and response, or "
                                   "messages: instruction tuning; text alone: a causal LM", "--train-data", "FILE")
    valid_data: str | None = _path("the validation file, same columns", "--valid-data", "FILE")
    tokenizer_model: str | None = _path("default: the checkpoint's tokenizer", "--tokenizer-model", "FILE")
    epochs: int = option(20, at_least(1), "", "--epochs")
    seq_length: int | str = option(64, _seq_length, "tokens per sample (longer ones are cut), or auto: the 95th "
                                   "percentile of the training samples' lengths", "--seq-length")
    hidden_dropout: float | None = option(None, optional(fraction), "default: the checkpoint's",
                                          "--hidden-dropout")
    attention_dropout: float | None = option(None, optional(fraction), "default: the checkpoint's",
                                             "--attention-dropout")
    save: str | None = _path("keep the best checkpoint (DIR/best) and the last (DIR/latest)", "--save", "DIR")
    log_dir: str | None = _path("metrics.jsonl (default: the --save dir, else runs/)", "--log-dir", "DIR")
    log_interval: int = option(10, at_least(1), "log the train loss every N steps", "--log-interval")

    def __post_init__(self) -> None:
        check_fields(self)
