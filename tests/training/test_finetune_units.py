"""Fine-tuning pieces in this process, no checkpoint or process group: the validation's devices,
label mappings, sample lengths and ``--seq-length auto``, the tokenizer check.

Texts are paragraphs of the Python standard library's documentation (real technical English, one
line each); labels are sparse integers or strings, as users' files have them.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from families import CAUSAL_LM, CLASSIFIER
from real_text import paragraphs

from tpzoo.checkpoint.tokenizer import model_tokenizer
from tpzoo.data.causal_lm import CausalLMDataset
from tpzoo.data.demo import demo_data
from tpzoo.data.tasks import Example, TaskDataset
from tpzoo.data.tokenizer import load_tokenizer, train_tokenizer
from tpzoo.training import finetune_loop
from tpzoo.training.finetune_args import FinetuneConfig, seq_length_flag
from tpzoo.training.finetune_lengths import auto_seq_length, length_report, percentile
from tpzoo.training.finetune_setup import finetune_data

pytestmark = pytest.mark.tier("unit")



# module -> a sparse integer label (its topic), as a user's file might number classes
TOPICS = {"json": 1, "csv": 1, "shutil": 2, "pathlib": 2, "tarfile": 2, "statistics": 3, "fractions": 3,
          "random": 3, "itertools": 5, "functools": 5, "heapq": 5, "textwrap": 7, "string": 7, "logging": 8,
          "subprocess": 8, "argparse": 8}


def stdlib_paragraphs(min_chars: int = 150, max_chars: int = 10_000) -> list[tuple[str, int]]:
    """(paragraph, topic label) of the documentation of ``TOPICS``' modules, each on one line."""
    return [(text, label) for name, label in TOPICS.items() for text in paragraphs(name, min_chars, max_chars)]


def write_labelled(path: Path, rows: list[tuple[str, object]]) -> str:
    path.write_text("".join(json.dumps({"text": text, "label": label}) + "\n" for text, label in rows))
    return str(path)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return load_tokenizer(demo_data()[0])


def test_validate_hands_labels_on_the_logits_device(monkeypatch):
    """The classifier's logits come on the mesh's device (cuda:0 on GPUs); the labels handed to
    classification_metrics must be there too. "meta" stands in for the GPU."""
    seen = {}
    monkeypatch.setattr(finetune_loop, "eval_logits",
                        lambda engine, batch: torch.zeros(len(batch["labels"]), 3, device="meta"))

    def metrics(logits, labels):
        seen.update(logits=logits.device, labels=labels.device)
        return {"val_loss": 1.0, "accuracy": 0.5}

    monkeypatch.setattr(finetune_loop, "classification_metrics", metrics)
    samples = [{"input_ids": torch.zeros(8, dtype=torch.long), "label": torch.tensor(i % 3)} for i in range(7)]
    run = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(global_batch_size=4)), valid=samples,
                          kind="classification")
    assert finetune_loop.validate(run) == {"val_loss": 1.0, "accuracy": 0.5}
    assert seen["labels"] == seen["logits"] == torch.device("meta"), seen


def test_tokenizer_vocab_must_match_the_model(tmp_path):
    """A tokenizer of another vocabulary size than the model's is refused either way, naming both sizes
    (finetune and generate share tpzoo.checkpoint.tokenizer.model_tokenizer)."""
    corpus = write_labelled(tmp_path / "corpus.jsonl", stdlib_paragraphs())
    other = train_tokenizer(corpus, str(tmp_path / "stdlib"), 384)
    for vocab in (384 + 128, 384 - 100):  # model larger than the tokenizer (main let it through), smaller
        with pytest.raises(ValueError, match=f"has 384 tokens but the model's vocabulary has {vocab}; pass"):
            model_tokenizer("ckpt", other, vocab_size=vocab)
    assert model_tokenizer("ckpt", other, vocab_size=384).vocab_size == 384


def test_percentiles_and_auto_seq_length():
    lengths = [10] * 90 + [50] * 5 + [400] * 5  # 100 samples: p95 is the 95th smallest
    assert (percentile(lengths, 50), percentile(lengths, 95), percentile(lengths, 100)) == (10, 50, 400)
    assert percentile([7], 95) == 7
    assert auto_seq_length(lengths, cap=256) == 50
    assert auto_seq_length([300] * 10, cap=256) == 256  # the model's max_position_embeddings caps it
    assert auto_seq_length([2] * 10, cap=256, minimum=5) == 5  # the least a sample needs
    assert auto_seq_length(lengths, cap=256, multiple=4) == 52  # sequence parallel: a multiple of tp
    assert auto_seq_length([300] * 10, cap=254, multiple=4) == 252
    assert length_report("training samples", lengths, 50, "are cut") == (
        "training samples: 100, tokens p50 10 / p95 50 / max 400; 5 (5.0%) longer than --seq-length 50 are cut")


def test_seq_length_flag_takes_an_integer_or_auto():
    assert seq_length_flag("64") == 64 and seq_length_flag("auto") == "auto"
    for bad in ("0", "x", "-3"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"an integer >= 1 or 'auto', got '{bad}'"):
            seq_length_flag(bad)


def test_dataset_lengths_are_the_uncut_token_counts(demo_tokenizer):
    """TaskDataset: [CLS] A [SEP] (B [SEP]) of the encoded texts; CausalLMDataset: the text's tokens. Setting
    seq_length again re-cuts without tokenising again, and every next-token target stays predicted once."""
    (a, _), (b, _), (c, _) = stdlib_paragraphs()[:3]
    tok = demo_tokenizer
    ds = TaskDataset([Example(a, None, 0), Example(b, c, 1)], tok, 32)
    assert ds.lengths == [len(tok.encode(a)) + 2, len(tok.encode(b)) + len(tok.encode(c)) + 3]
    ds.seq_length = max(ds.lengths)
    assert ds[1]["attention_mask"].sum() == ds.lengths[1] and ds[0]["attention_mask"].sum() == ds.lengths[0]
    with pytest.raises(ValueError, match="seq_length 4 is too short for a task sample; use 5 or more"):
        ds.seq_length = 4
    lm = CausalLMDataset([a, b], tok, 16)
    assert lm.lengths == [len(tok.encode(a)), len(tok.encode(b))]
    for s in (16, 1000):
        lm.seq_length = s
        assert len(lm) == sum(math.ceil(n / s) for n in lm.lengths)
        targets = [t for i in range(len(lm)) for t in lm[i]["labels"].tolist() if t != -100]
        assert targets == tok.encode(a)[1:] + [tok.eod] + tok.encode(b)[1:] + [tok.eod]


def data_args(tmp_path: Path, train: list, valid: list, **flags) -> FinetuneConfig:
    files = dict(train_data=write_labelled(tmp_path / "train.jsonl", train),
                 valid_data=write_labelled(tmp_path / "valid.jsonl", valid))
    return FinetuneConfig(**{**dict(load="ckpt", seq_length=64, **files), **flags})


def test_sparse_integer_labels_are_six_classes_and_long_samples_reported(tmp_path, demo_tokenizer):
    """Labels 1 2 3 5 7 8 are 6 classes (not 9), printed once; real paragraphs are longer than the
    default 64 tokens, and the report says how many are cut; auto picks the training p95."""
    rows = stdlib_paragraphs()
    train, valid = rows[::2], rows[1::2]
    config = CLASSIFIER.config()
    args = data_args(tmp_path, train, valid)
    ds_train, ds_valid, names, report = finetune_data(args, "classification", demo_tokenizer, config, {})
    assert names == ["1", "2", "3", "5", "7", "8"] and report[0] == "6 classes: 1 2 3 5 7 8"
    assert sorted({e.label for e in ds_train.examples}) == [0, 1, 2, 3, 4, 5]
    lengths = [len(demo_tokenizer.encode(text)) + 2 for text, _ in train]
    over = sum(n > 64 for n in lengths)
    assert over > len(train) // 2, "the paragraphs should be longer than 64 tokens"
    assert report[1].startswith(f"training samples: {len(train)}, tokens p50 ") and report[1].endswith(
        f"; {over} ({over / len(train):.1%}) longer than --seq-length 64 are cut")
    assert report[2].startswith(f"validation samples: {len(valid)}, ")

    p95 = sorted(lengths)[math.ceil(0.95 * len(lengths)) - 1]
    for cap in (p95 + 100, p95 - 10):  # the pick is the p95, unless max_position_embeddings is below it
        auto = data_args(tmp_path, train, valid, seq_length="auto")
        ds_train, ds_valid, _, report = finetune_data(auto, "classification", demo_tokenizer,
                                                      config.replace(max_position_embeddings=cap), {})
        pick = min(p95, cap)
        assert ds_train.seq_length == ds_valid.seq_length == pick
        assert report[1] == (f"--seq-length auto: {pick} (the training samples' 95th percentile length is {p95}; "
                             f"the model's max_position_embeddings is {cap})")
        assert ds_train[0]["input_ids"].shape == (pick,)


def test_string_labels_sorted_and_causal_lm_documents_reported(tmp_path, demo_tokenizer):
    rows = [(text, {1: "formats", 2: "files", 3: "math", 5: "iteration", 7: "text", 8: "processes"}[label])
            for text, label in stdlib_paragraphs()]
    args = data_args(tmp_path, rows[::2], rows[1::2], seq_length="auto")
    _, _, names, report = finetune_data(args, "classification", demo_tokenizer, CLASSIFIER.config(), {})
    assert names == ["files", "formats", "iteration", "math", "processes", "text"]
    assert report[0] == "6 classes: files formats iteration math processes text"
    causal = CAUSAL_LM.config()
    train, _, names, report = finetune_data(data_args(tmp_path, rows[::2], rows[1::2], seq_length="auto"),
                                            "causal-lm", demo_tokenizer, causal, {})
    assert names is None and report[0].startswith("--seq-length auto: ")
    assert train.seq_length == min(percentile(train.lengths, 95), causal.max_position_embeddings)
    assert report[1].startswith(f"training documents: {len(rows[::2])}, ")
    assert report[1].endswith("span several windows")


def test_saved_label_mapping_is_reused(tmp_path, demo_tokenizer):
    """A fine-tuned classifier's checkpoint records its label names: data read for it maps through them
    (files with only labels 2 and 7 are classes 1 and 4 of 6, not a new 2-class mapping), and a label
    it never saw is a clear error."""
    rows = [(text, label) for text, label in stdlib_paragraphs() if label in (2, 7)]
    meta = {"label_names": ["1", "2", "3", "5", "7", "8"]}
    args = data_args(tmp_path, rows[::2], rows[1::2])
    train, valid, names, report = finetune_data(args, "classification", demo_tokenizer, CLASSIFIER.config(), meta)
    assert names == meta["label_names"] and report[0] == "6 classes (the labels of --load ckpt): 1 2 3 5 7 8"
    assert [e.label for e in train.examples] == [{2: 1, 7: 4}[y] for _, y in rows[::2]]
    with pytest.raises(ValueError, match=r"'.*valid.jsonl' has labels \['4'\] that the classifier --load ckpt was "
                                         r"not fine-tuned on \(its labels: \['1', '2', '3', '5', '7', '8'\]\)"):
        finetune_data(data_args(tmp_path, rows, [(rows[0][0], 4)]), "classification", demo_tokenizer,
                      CLASSIFIER.config(), meta)


@pytest.mark.parametrize("rows, kind", [
    ([{"text": "the cat", "label": "pets"}], "classification"),
    ([{"prompt": "the cat?", "response": "sat"}], "sft"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}], "sft"),
    ([{"text": "the cat sat"}], "causal-lm"),
])
def test_the_route_follows_the_data_and_is_said(tmp_path, rows, kind):
    """A decoder checkpoint: labelled rows make its classifier, instructions instruction-tune it, text alone
    fine-tunes it as a causal LM; an encoder checkpoint's family takes labelled data only."""
    from tpzoo.models.families import family
    from tpzoo.training.finetune_setup import route

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tune = FinetuneConfig(load="ckpt", train_data=str(path), valid_data=str(path))
    decoder, encoder = family(CAUSAL_LM.family), family(CLASSIFIER.family)
    got, target, said = route(tune, decoder, CAUSAL_LM.model)
    spec = decoder.spec
    assert (got, target) == (kind, spec.classifier_model if kind == "classification" else spec.finetune_model)
    assert said.startswith(f"route: {path}") and f"--load's {CAUSAL_LM.model} fine-tunes as {target}" in said
    if kind == "sft":
        with pytest.raises(ValueError, match=f"the {encoder.name} family has no causal LM to instruction-tune"):
            route(tune, encoder, CLASSIFIER.model)
    assert route(FinetuneConfig(load="ckpt", task="demo"), decoder, CAUSAL_LM.model)[:2] == (
        "classification", spec.classifier_model)
