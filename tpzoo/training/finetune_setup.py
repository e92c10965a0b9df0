"""What a fine-tuning run is built from, before its first step: the pretrained model (its kind from
the checkpoint's family), the tokenizer, the task's data, the model config, the plan and the engine.

    run = build_finetune(job, tune)  # RunConfig, FinetuneConfig; ValueError/FileNotFoundError on misuse
    run.kind                         # the route: "classification" (labels), "sft" (instructions), "causal-lm" (text)
    run.engine, run.train, run.valid, run.label_names
    run.report                       # lines finetune() prints once: the classes, the sample lengths

``--load`` is a training checkpoint (``pretrain.py``'s or ``finetune.py``'s) or a tpzoo model folder
(``python -m tpzoo.convert from-hf``). The route follows the data (``route``): labelled data (``--task``, or
files with a ``label`` field) trains the family's ``classifier_model`` (``tpzoo.models.families``): a BERT
becomes a ``BertForSequenceClassification`` (encoder and, where saved, pooler loaded), a decoder its
``...ForSequenceClassification`` (the last real token's hidden state into ``score``), each with a fresh head
of ``num_labels`` = the task's classes; text without labels trains the family's ``finetune_model`` (a
decoder stays a causal LM). The route is said in the first lines the run prints.

Classifier labels: a ``--load`` checkpoint that records ``label_names`` (a ``finetune.py`` one) maps
the data files' labels through them; else the training file's labels become ids in ``label_order``;
``--task`` has its own fixed list. ``--seq-length auto``: the 95th percentile of the training
samples' lengths, within [the least a sample needs, max_position_embeddings] (``finetune_lengths``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tpzoo.checkpoint import load_model, read_meta
from tpzoo.checkpoint.model import recorded_config
from tpzoo.checkpoint.tokenizer import model_tokenizer
from tpzoo.data.causal_lm import CausalLMDataset, read_texts
from tpzoo.data.sft import SFTDataset, read_conversations
from tpzoo.data.sources import one_file, rows
from tpzoo.data.tasks import TaskDataset, UnknownLabels, load_task, read_examples
from tpzoo.data.tokenizer import Tokenizer
from tpzoo.engine import Engine
from tpzoo.lora_options import LoRAConfig
from tpzoo.models.base import reads_token_types
from tpzoo.models.config import ModelConfig
from tpzoo.models.families import Family, family, model_class
from tpzoo.models.pretrained import CONFIG_FILE, read_pretrained
from tpzoo.parallel import ParallelMesh, manual_seed
from tpzoo.parallel.lora import add_adapters
from tpzoo.data.batches import num_batches
from tpzoo.training.elastic import place
from tpzoo.training.finetune_args import FinetuneConfig
from tpzoo.training.finetune_lengths import AUTO, AUTO_PERCENTILE, auto_seq_length, length_report, percentile
from tpzoo.training.lr_schedule import LRSchedule
from tpzoo.training.model_args import model_config
from tpzoo.training.run_config import RunConfig
from tpzoo.training.setup import default_run_dir

# what a sample of each kind is, and what happens to one longer than --seq-length
SAMPLES = {"classification": ("samples", "are cut"), "causal-lm": ("documents", "span several windows"),
           "sft": ("examples", "are cut")}


@dataclass
class FinetuneRun:
    job: RunConfig                    # the flags' sections
    tune: FinetuneConfig              # finetune.py's own, --seq-length auto resolved to the length picked
    mesh: ParallelMesh
    kind: str                         # the route (``route``): "classification", "sft" or "causal-lm"
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
    adapters_of: str | None = None    # --save-adapters-only: the --load checkpoint the adapters are saved against

    def meta(self, **extra: Any) -> dict[str, Any]:
        """What a checkpoint of this run records besides the tensors (JSON-able)."""
        return dict(model=self.config.model_type, model_config=self.config.to_dict(),
                    tokenizer=self.tokenizer.reference(), finetune=self.kind, label_names=self.label_names,
                    args=self.flags(), **extra)

    def flags(self) -> dict[str, Any]:
        """The run's flags as they were resolved: the family and sequence length it fine-tunes with."""
        return {**self.job.flags, "model": self.config.model_type, "preset": None, "seq_length": self.tune.seq_length}


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


def classification_data(tune: FinetuneConfig, tokenizer: Tokenizer, seq_length: int,
                        saved_names: list[str] | None = None, token_types: bool = True
                        ) -> tuple[TaskDataset, TaskDataset, list[str]]:
    """(train, valid, label names) of ``--task`` (``--data-dir`` for GLUE) or ``--train-data/--valid-data``,
    whose labels map through ``saved_names`` (the ``--load`` classifier's) when given; ``token_types``: the samples
    hold token types (a model that reads segments: BERT)."""
    if tune.task:
        train, names = load_task(tune.task, "train", tune.data_dir)
        valid, _ = load_task(tune.task, "valid", tune.data_dir)
    else:
        try:
            train, names = read_examples(tune.train_data, saved_names)
            check_label_count(names)  # before the validation file is read against them
            valid, _ = read_examples(tune.valid_data, names)
        except UnknownLabels as err:
            if saved_names is None:
                raise
            raise ValueError(f"{err.path!r} has labels {err.unknown} that the classifier --load {tune.load} was not "
                             f"fine-tuned on (its labels: {err.known}); fix the file, or fine-tune the checkpoint "
                             f"it was fine-tuned from for new labels") from None
    check_label_count(names)
    train, valid = (TaskDataset(examples, tokenizer, seq_length, token_types) for examples in (train, valid))
    return train, valid, names


def finetune_data(tune: FinetuneConfig, kind: str, tokenizer: Tokenizer, saved: ModelConfig,
                  meta: dict[str, Any], multiple: int = 1, token_types: bool = True
                  ) -> tuple[Any, Any, list[str] | None, list[str]]:
    """(train, valid, label names, report lines) of the run; ``--seq-length auto`` is resolved here from the
    training samples' lengths (a multiple of ``multiple``: tp under sequence parallelism), the datasets' seq_length
    the pick; ``token_types``: classifier samples hold token types."""
    auto = tune.seq_length == AUTO
    seq_length = saved.max_position_embeddings if auto else tune.seq_length  # auto: cut again below
    names, report = None, []
    if kind == "classification":
        saved_names = meta.get("label_names")
        train, valid, names = classification_data(tune, tokenizer, seq_length, saved_names, token_types)
        report.append(f"{len(names)} classes" + (f" (the labels of --load {tune.load})" if saved_names else "")
                      + ": " + " ".join(n if n.split() == [n] else repr(n) for n in names))
    elif kind == "sft":
        train, valid = (SFTDataset(read_conversations(path), tokenizer, seq_length)
                        for path in (tune.train_data, tune.valid_data))
        report.append(f"formatted by the {train.template} template (docs/finetuning.md); the loss on the answers "
                      f"only, examples packed into sequences of --seq-length without crossing")
    else:
        train, valid = (CausalLMDataset(read_texts(path), tokenizer, seq_length)
                        for path in (tune.train_data, tune.valid_data))
    noun, cut = SAMPLES[kind]
    trained = meta.get("args", {}).get("seq_length")  # the positions --load was trained on (its run's length)
    if auto:
        tp, cap = multiple, saved.max_position_embeddings
        pick = train.seq_length = valid.seq_length = auto_seq_length(train.lengths, cap, train.min_length, tp)
        report.append(f"--seq-length auto: {pick} (the training {noun}' {AUTO_PERCENTILE}th percentile "
                      f"length is {percentile(train.lengths, AUTO_PERCENTILE)}; the model's max_position_embeddings is "
                      f"{cap}" + (f"; a multiple of tp={tp} under --sequence-parallel" if tp > 1 else "") + ")")
    if trained and train.seq_length > trained:
        report.append(f"--seq-length {train.seq_length} is longer than the {trained} tokens --load was trained on: "
                      f"positions past {trained} start from what pretraining left them")
    report += [length_report(f"{split} {noun}", data.lengths, train.seq_length, cut)
               for split, data in (("training", train), ("validation", valid))]
    return train, valid, names, report


def check_data_args(tune: FinetuneConfig) -> None:
    """Exactly one data source."""
    files = tune.train_data is not None or tune.valid_data is not None
    if tune.task and files:
        raise ValueError("pass either --task or --train-data/--valid-data, not both")
    if files and (tune.train_data is None or tune.valid_data is None):
        raise ValueError("--train-data and --valid-data go together; pass both")
    if not tune.task and not files:
        raise ValueError("no data: pass --task NAME or --train-data FILE --valid-data FILE")


def route(tune: FinetuneConfig, fam: Family, class_name: str) -> tuple[str, str, str]:
    """(kind, model class, the line saying why) of the run, from the data: labelled (``--task``, or a training file
    whose first row has a ``label`` field) trains the family's classifier; instructions (``prompt`` and
    ``response``, or ``messages``) a causal LM on the answers ("sft"); text alone, the family's ``finetune_model``."""
    spec = fam.spec
    if tune.task:
        kind, source = "classification", f"--task {tune.task} is a classification task"
    else:
        fields = set(next(rows(one_file(tune.train_data)), {}))
        kind = ("classification" if "label" in fields else "sft" if "messages" in fields or {"prompt", "response"}
                <= fields else fam.finetune)
        source = (f"{tune.train_data} has " + ("a 'label' field" if kind == "classification" else "instructions" if
                  kind == "sft" else f"no 'label', 'prompt'/'response' or 'messages' field (its fields: "
                  f"{', '.join(sorted(fields))})"))
    if kind == "classification" and spec.classifier_model is None or kind == "sft" and fam.finetune != "causal-lm":
        what = "sequence classifier" if kind == "classification" else "causal LM to instruction-tune"
        raise ValueError(f"{source}, but the {fam.name} family has no {what}; it fine-tunes as a {fam.finetune}")
    target = spec.classifier_model if kind == "classification" else spec.finetune_model
    what = {"classification": "a classifier" + (", its head new" if target != class_name else ""),
            "sft": "a causal LM, the loss on the answers only",
            "causal-lm": "a causal LM: the next-token loss on the text"}[kind]
    return kind, target, f"route: {source}, so --load's {class_name} fine-tunes as {target} ({what})"


def build_finetune(job: RunConfig, tune: FinetuneConfig, lora: LoRAConfig = LoRAConfig()) -> FinetuneRun:
    """Everything the fine-tuning run of ``job``, ``tune`` and ``lora`` (adapters, when its rank is set) needs,
    checked before any training."""
    if not tune.load:
        raise ValueError("--load is required: the pretrained checkpoint or model folder to fine-tune")
    if job.parallel.elastic:  # dp from this launch's world size; a spare rank exits here
        place(job.parallel, job.training.global_batch_size, job.training.micro_batch_size)
    class_name, saved, meta = saved_model(tune.load)
    fam = family(saved.model_type)
    check_data_args(tune)
    kind, target, said = route(tune, fam, class_name)
    if lora.enabled and kind == "classification":
        raise ValueError(f"--lora-rank {lora.rank}: LoRA fine-tunes causal LMs here; this run trains {target} "
                         f"(labelled data), whose new head trains whole: drop the --lora flags")
    tokenizer = model_tokenizer(tune.load, tune.tokenizer_model, vocab_size=saved.vocab_size)
    parallel = job.parallel
    train, valid, names, report = finetune_data(tune, kind, tokenizer, saved, meta,
                                                parallel.tp if parallel.sequence_parallel else 1,
                                                reads_token_types(model_class(target, fam.name)))
    report.insert(0, said)
    tune = dataclasses.replace(tune, seq_length=train.seq_length)  # auto: the length picked
    changes: dict[str, Any] = {}
    if kind == "classification":
        if class_name == target and saved.num_labels != len(names):
            raise ValueError(f"--load {tune.load} is a classifier of {saved.num_labels} labels but the data has "
                             f"{len(names)} ({names}); fine-tune a {fam.spec.pretrain_model} checkpoint instead")
        changes = dict(num_labels=len(names))
    ecfg = job.engine()
    t = job.training
    total = tune.epochs * num_batches(len(train), ecfg.global_batch_size)
    # in iterations: iteration i runs at lr_at(i), the warmup rising from --lr-warmup-init
    schedule = LRSchedule(t.lr, t.min_lr, t.lr_warmup_iters, total, t.lr_decay_style, t.lr_warmup_init)
    choice = dataclasses.replace(job.model, model=saved.model_type, preset=None, seq_length=tune.seq_length)
    config = model_config(choice, saved, **changes)  # the checkpoint's, with the dropout flags given
    overrides = {k: v for k, v in config.to_dict().items() if saved.to_dict()[k] != v}
    mesh = parallel.mesh()
    manual_seed(t.seed, mesh)
    build = functools.partial(load_model, tune.load, model_class=target if target != class_name else None,
                              config_overrides=overrides)
    if lora.enabled:
        build = functools.partial(_with_adapters, build, lora, t.seed)
    engine = Engine(build, config, ecfg, job.plan(mesh))
    save_dir = Path(tune.save) if tune.save else None
    log_dir = Path(tune.log_dir) if tune.log_dir else save_dir or default_run_dir(f"finetune-{saved.model_type}")
    adapters_of = str(Path(tune.load).resolve()) if lora.save_adapters_only else None
    return FinetuneRun(job, tune, mesh, kind, tokenizer, config, engine, train, valid, names, schedule, save_dir,
                       log_dir, report, adapters_of)


def _with_adapters(build: Callable[..., Any], lora: LoRAConfig, seed: int, plan: Any, **stage: Any) -> Any:
    """``build``'s model (stage) with LoRA adapters added and the rest frozen (``tpzoo.parallel.lora``)."""
    model = build(plan, **stage)
    had = getattr(model, "adapters", None)  # a checkpoint fine-tuned with LoRA loads with its adapters
    if had is None:
        add_adapters(model, lora, seed)
    elif {k: had[k] for k in ("rank", "alpha", "targets")} != {"rank": lora.rank, "alpha": lora.alpha,
                                                                "targets": lora.targets}:
        raise ValueError(f"--load holds LoRA adapters of rank {had['rank']}, alpha {had['alpha']} on {had['targets']}; "
                         f"the --lora flags ask for rank {lora.rank}, alpha {lora.alpha} on {lora.targets}: drop them or "
                         f"make them agree")
    return model
