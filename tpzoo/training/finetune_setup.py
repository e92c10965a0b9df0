"""What a fine-tuning run is built from, before its first step: the pretrained model (its kind from
the checkpoint's family), the tokenizer, the task's data, the model config, the plan and the engine.

    run = build_finetune(args)     # ValueError/FileNotFoundError on misuse, before any training
    run.kind                       # the family's ``finetune``: "classification" (BERT) or "causal-lm" (GPT, Llama)
    run.engine, run.train, run.valid, run.label_names
    run.report                     # lines finetune() prints once: the classes, the sample lengths

``--load`` is a training checkpoint (``pretrain.py``'s or ``finetune.py``'s) or a tpzoo model folder
(``python -m tpzoo.convert from-hf``). The model built is the family's ``finetune_model``
(``tpzoo.models.families``): a BERT checkpoint becomes a ``BertForSequenceClassification`` (encoder
and, where saved, pooler loaded; a fresh head of ``num_labels`` = the task's classes); a GPT or Llama
checkpoint stays a causal LM.

Classifier labels: a ``--load`` checkpoint that records ``label_names`` (a ``finetune.py`` one) maps
the data files' labels through them; else the training file's labels become ids in ``label_order``;
``--task`` has its own fixed list. ``--seq-length auto``: the 95th percentile of the training
samples' lengths, within [the least a sample needs, max_position_embeddings] (``finetune_lengths``).
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpzoo.checkpoint import load_model, read_meta
from tpzoo.checkpoint.model import recorded_config
from tpzoo.checkpoint.tokenizer import model_tokenizer
from tpzoo.data.causal_lm import CausalLMDataset, read_texts
from tpzoo.data.tasks import TaskDataset, UnknownLabels, load_task, read_examples
from tpzoo.data.tokenizer import Tokenizer
from tpzoo.engine import Engine
from tpzoo.models.config import ModelConfig
from tpzoo.models.families import FAMILIES, family
from tpzoo.models.pretrained import CONFIG_FILE, read_pretrained
from tpzoo.parallel import ParallelMesh, init_mesh, manual_seed
from tpzoo.data.batches import num_batches
from tpzoo.training.args import model_config
from tpzoo.training.finetune_lengths import AUTO, AUTO_PERCENTILE, auto_seq_length, length_report, percentile
from tpzoo.training.lr_schedule import LRSchedule
from tpzoo.training.run_config import RunConfig
from tpzoo.training.setup import default_run_dir

# what a sample of each kind is, and what happens to one longer than --seq-length
SAMPLES = {"classification": ("samples", "are cut"), "causal-lm": ("documents", "span several windows")}


@dataclass
class FinetuneRun:
    args: argparse.Namespace
    job: RunConfig                    # the flags' sections
    mesh: ParallelMesh
    kind: str                         # the family's finetune kind: "classification" or "causal-lm"
    tokenizer: Tokenizer
    config: ModelConfig               # the fine-tuned model's
    engine: Engine
    train: Any                        # map-style dataset of samples (TaskDataset / CausalLMDataset)
    valid: Any
    label_names: list[str] | None     # classification: the label of each class id
    schedule: LRSchedule              # over epochs x batches per epoch iterations
    save_dir: Path | None
    log_dir: Path
    report: list[str]                 # printed once before training: classes, sample lengths

    def meta(self, **extra: Any) -> dict[str, Any]:
        """What a checkpoint of this run records besides the tensors (JSON-able)."""
        return dict(model=self.config.model_type, model_config=self.config.to_dict(),
                    tokenizer=self.tokenizer.reference(), finetune=self.kind, label_names=self.label_names,
                    args=vars(self.args), **extra)


def saved_model(path: str) -> tuple[str, ModelConfig, dict[str, Any]]:
    """(class name, config, meta) of the model at ``path``: a model folder (meta {}) or a checkpoint."""
    if (Path(path) / CONFIG_FILE).is_file():
        class_name, _, config, _ = read_pretrained(path)
        return class_name, config, {}
    meta = read_meta(path)
    record = meta["checkpoint"]["model"]
    return record["class"], recorded_config(record), meta


def check_label_count(names: list[str]) -> None:
    """ValueError unless the training data has two or more labels: what a classifier tells apart."""
    if len(names) < 2:
        raise ValueError(f"the training data has only the label {names}; a classifier needs two or more")


def classification_data(args: argparse.Namespace, tokenizer: Tokenizer, seq_length: int,
                        saved_names: list[str] | None = None) -> tuple[TaskDataset, TaskDataset, list[str]]:
    """(train, valid, label names) of ``--task`` (``--data-dir`` for GLUE) or ``--train-data/--valid-data``,
    whose labels map through ``saved_names`` (the ``--load`` classifier's) when given."""
    if args.task:
        train, names = load_task(args.task, "train", args.data_dir)
        valid, _ = load_task(args.task, "valid", args.data_dir)
    else:
        try:
            train, names = read_examples(args.train_data, saved_names)
            check_label_count(names)  # before the validation file is read against them
            valid, _ = read_examples(args.valid_data, names)
        except UnknownLabels as err:
            if saved_names is None:
                raise
            raise ValueError(f"{err.path!r} has labels {err.unknown} that the classifier --load {args.load} was not "
                             f"fine-tuned on (its labels: {err.known}); fix the file, or fine-tune a BERT encoder "
                             f"checkpoint for new labels") from None
    check_label_count(names)
    return TaskDataset(train, tokenizer, seq_length), TaskDataset(valid, tokenizer, seq_length), names


def finetune_data(args: argparse.Namespace, kind: str, tokenizer: Tokenizer, saved: ModelConfig,
                  meta: dict[str, Any]) -> tuple[Any, Any, list[str] | None, list[str]]:
    """(train, valid, label names, report lines) of the run; ``--seq-length auto`` is resolved here
    (``args.seq_length`` becomes the pick) from the training samples' lengths."""
    auto = args.seq_length == AUTO
    seq_length = saved.max_position_embeddings if auto else args.seq_length  # auto: cut again below
    names, report = None, []
    if kind == "classification":
        saved_names = meta.get("label_names")
        train, valid, names = classification_data(args, tokenizer, seq_length, saved_names)
        report.append(f"{len(names)} classes" + (f" (the labels of --load {args.load})" if saved_names else "")
                      + ": " + " ".join(n if n.split() == [n] else repr(n) for n in names))
    else:
        train, valid = (CausalLMDataset(read_texts(path), tokenizer, seq_length)
                        for path in (args.train_data, args.valid_data))
    noun, cut = SAMPLES[kind]
    if auto:
        tp, cap = args.tp if args.sequence_parallel else 1, saved.max_position_embeddings
        pick = auto_seq_length(train.lengths, cap, train.min_length, tp)
        args.seq_length = train.seq_length = valid.seq_length = pick
        report.append(f"--seq-length auto: {args.seq_length} (the training {noun}' {AUTO_PERCENTILE}th percentile "
                      f"length is {percentile(train.lengths, AUTO_PERCENTILE)}; the model's max_position_embeddings is "
                      f"{cap}" + (f"; a multiple of tp={tp} under --sequence-parallel" if tp > 1 else "") + ")")
    report += [length_report(f"{split} {noun}", data.lengths, args.seq_length, cut)
               for split, data in (("training", train), ("validation", valid))]
    return train, valid, names, report


def check_data_args(args: argparse.Namespace, kind: str, class_name: str) -> None:
    """Exactly one data source, and one that fits the checkpoint's kind."""
    files = args.train_data is not None or args.valid_data is not None
    if args.task and files:
        raise ValueError("pass either --task or --train-data/--valid-data, not both")
    if files and (args.train_data is None or args.valid_data is None):
        raise ValueError("--train-data and --valid-data go together; pass both")
    if not args.task and not files:
        raise ValueError("no data: pass --task NAME or --train-data FILE --valid-data FILE")
    if args.task and kind == "causal-lm":
        classifiers = [f.name for f in FAMILIES.values() if f.finetune == "classification"]
        raise ValueError(f"--load {args.load} holds a {class_name.removesuffix('Model')} model, which fine-tunes "
                         f"as a causal LM on --train-data/--valid-data text files; --task {args.task} needs a "
                         f"checkpoint of a classifier family ({', '.join(classifiers)})")


def build_finetune(args: argparse.Namespace) -> FinetuneRun:
    """Everything a fine-tuning run needs, checked before any training."""
    if not args.load:
        raise ValueError("--load is required: the pretrained checkpoint or model folder to fine-tune")
    class_name, saved, meta = saved_model(args.load)
    fam = family(saved.model_type)
    spec, kind = fam.spec, fam.finetune
    check_data_args(args, kind, class_name)
    tokenizer = model_tokenizer(args.load, args.tokenizer_model, vocab_size=saved.vocab_size)
    train, valid, names, report = finetune_data(args, kind, tokenizer, saved, meta)
    changes: dict[str, Any] = {}
    if kind == "classification":
        if class_name == spec.finetune_model and saved.num_labels != len(names):
            raise ValueError(f"--load {args.load} is a classifier of {saved.num_labels} labels but the data has "
                             f"{len(names)} ({names}); fine-tune a {spec.pretrain_model} checkpoint instead")
        changes = dict(num_labels=len(names))
    job = RunConfig.of(vars(args))
    ecfg = job.engine()
    total = args.epochs * num_batches(len(train), ecfg.global_batch_size)
    # in iterations: iteration i runs at lr_at(i), the warmup rising from --lr-warmup-init
    schedule = LRSchedule(args.lr, args.min_lr, args.lr_warmup_iters, total, args.lr_decay_style, args.lr_warmup_init)
    args.model, args.preset = saved.model_type, None  # what model_config checks the flags against
    config = model_config(args, saved, **changes)
    overrides = {k: v for k, v in config.to_dict().items() if saved.to_dict()[k] != v}
    model_class = spec.finetune_model if spec.finetune_model != class_name else None
    mesh = init_mesh(job.parallel.tp, job.parallel.pp, job.parallel.dp, timeout=job.parallel.timeout)
    manual_seed(args.seed, mesh)
    build = functools.partial(load_model, args.load, model_class=model_class, config_overrides=overrides)
    engine = Engine(build, config, ecfg, job.plan(mesh))
    save_dir = Path(args.save) if args.save else None
    log_dir = Path(args.log_dir) if args.log_dir else save_dir or default_run_dir(f"finetune-{saved.model_type}")
    return FinetuneRun(args, job, mesh, kind, tokenizer, config, engine, train, valid, names, schedule, save_dir, log_dir,
                       report)
