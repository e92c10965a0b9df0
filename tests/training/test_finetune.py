"""finetune.py end to end.

The commands and Python block of docs/finetuning.md (and README's fine-tuning command) run once, in one folder
(module fixture), each after the commands whose folders it reads, two at a time: they pretrain a BERT and a
GPT with pretrain.py, export the BERT to Hugging Face and convert it back, and fine-tune each. The tests
then read what those runs wrote: the accuracy reached, the GPT's validation loss, the best checkpoint.
Apart from them: sentence pairs from data files at tp=1 and under torchrun at tp=2 (the same numbers, both
runs at once), real paragraphs with sparse integer labels and ``--seq-length auto``, and misuse.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import shlex
import sys
from pathlib import Path

import background
import pytest
import torch

from doc_helpers import ROOT, blocks, run, run_as_needed
from families import CAUSAL_LM, CLASSIFIER, DECODER_CLASSIFIER
from test_finetune_units import stdlib_paragraphs, write_labelled
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("journey")



DOC = "finetuning.md"
README = "../README.md"  # blocks() reads docs/<name>
RECIPE = "## A recipe on real text"
PRETRAINED_ACCURACY = 0.65  # the demo task from the pretrain.py checkpoint, 5 epochs (measured 0.93)
MAJORITY = 0.528           # the demo validation set's share of class 0
DECODER_MARGIN = 0.1       # the GPT classifier over the majority class (measured 0.836, default seed)
SFT_LOSS = 0.3             # the answers' validation loss after instruction tuning (measured 0.148)


def commands() -> list[str]:
    """The shell commands of docs/finetuning.md but its recipe on real text (tests/training/test_finetune_recipe.py
    runs that at a small scale), then README's fine-tuning ones."""
    doc = [line for block in blocks(DOC, "bash", skip=RECIPE) for line in block.splitlines() if line.strip()]
    readme = [line for block in blocks(README, "bash") for line in block.splitlines() if "finetune.py" in line]
    assert readme, "README shows no finetune.py command"
    return doc + [line for line in readme if line not in doc]  # README's example is one of the doc's


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def epochs(path: Path) -> list[dict]:
    """The per-epoch (validation) lines of a metrics.jsonl."""
    return [r for r in metrics(path) if "epoch" in r]


@background.fixture
def docs_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("finetune-docs")
    for script in ("pretrain.py", "finetune.py"):
        (folder / script).symlink_to(ROOT / script)
    (folder / "stdout.txt").write_text("".join(done.stdout for done in run_as_needed(commands(), folder)))
    for code in blocks(DOC, "python"):
        done = run([sys.executable, "-c", code], folder)
        assert done.returncode == 0 and "accuracy" in done.stdout, f"{DOC} python block failed:\n{done.stderr[-3000:]}"
    return folder


def test_doc_commands_score_every_epoch(docs_dir):
    """BERT from pretrain.py and from Hugging Face: a validation line per epoch with accuracy and F1."""
    for run_dir in ("bert-demo", "bert-hf-demo"):
        scores = epochs(docs_dir / run_dir / "metrics.jsonl")
        print(run_dir, [(r["epoch"], r["accuracy"], r["f1"], r["val_loss"]) for r in scores])
        assert [r["epoch"] for r in scores] == [1, 2, 3, 4, 5]
        assert all(0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["f1"] <= 1.0 and r["val_loss"] > 0 for r in scores)


def test_doc_output_lines_are_what_the_commands_print(docs_dir):
    """The class and sample-length lines docs/finetuning.md shows (indented, unlike commands) are printed as shown."""
    starts = ("2 classes: ", "--seq-length auto: ", "training samples: ", "validation samples: ",
              "training documents: ", "validation documents: ")
    shown = [line.strip() for line in (ROOT / "docs" / DOC).read_text().splitlines()
             if line.startswith("    ") and line.strip().startswith(starts)]
    assert len(shown) == 6, shown
    printed = (docs_dir / "stdout.txt").read_text().splitlines()
    assert [line for line in shown if line not in printed] == [], printed


def test_pretrained_bert_reaches_the_stated_accuracy(docs_dir):
    """The accuracies docs/finetuning.md states: the pretrain.py checkpoint reaches PRETRAINED_ACCURACY
    (measured 0.930; chance is 0.528), and so does that model after a round trip through Hugging
    Face's format (to-hf, from-hf)."""
    best = {d: max(r["accuracy"] for r in epochs(docs_dir / d / "metrics.jsonl")) for d in ("bert-demo", "bert-hf-demo")}
    print("best accuracy", best)
    assert best["bert-demo"] >= PRETRAINED_ACCURACY, best
    assert abs(best["bert-hf-demo"] - best["bert-demo"]) <= 0.01, best


def test_gpt_causal_lm_validation_loss_falls(docs_dir):
    scores = epochs(docs_dir / "gpt-demo" / "metrics.jsonl")
    print("causal LM", [(r["epoch"], r["val_loss"], r["perplexity"]) for r in scores])
    losses = [r["val_loss"] for r in scores]
    assert losses[1] < losses[0], scores
    assert abs(scores[1]["perplexity"] - 2.718281828 ** losses[1]) < 1e-6 * scores[1]["perplexity"]


def test_gpt_classifier_beats_the_majority_class_and_a_random_start(docs_dir, tmp_path):
    """The decoder-classifier command: from the pretrain.py checkpoint the best accuracy beats the majority class
    (0.528) by DECODER_MARGIN; the same flags from a randomly initialised GPT of that shape (a model folder) do no
    better. The route is said before training."""
    from tpzoo.checkpoint import read_meta
    from tpzoo.checkpoint.model import recorded_config
    from tpzoo.models.pretrained import write_pretrained

    said = (docs_dir / "stdout.txt").read_text()
    lm = CAUSAL_LM  # pretrain.py's default family, whose classifier the command trains
    assert DECODER_CLASSIFIER.family == lm.family
    assert f"so --load's {lm.model} fine-tunes as {DECODER_CLASSIFIER.model}" in said
    pretrained = max(r["accuracy"] for r in epochs(docs_dir / "gpt-classifier" / "metrics.jsonl"))
    config = recorded_config(read_meta(docs_dir / "gpt-pretrained")["checkpoint"]["model"])
    model = lm.model_class(config, seed=7)
    write_pretrained(tmp_path / "random", lm.model, {}, config, model.state_dict())
    command = next(c for c in commands() if "--save gpt-classifier" in c)
    flags = shlex.split(command.replace("--load gpt-pretrained", f"--load {tmp_path / 'random'} --tokenizer-model "
                                        f"{docs_dir / 'demo_files' / 'tokenizer.model'}"))[2:]
    flags[flags.index("--save") + 1] = str(tmp_path / "random-classifier")
    done = run([sys.executable, "finetune.py", *flags], docs_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    random_start = max(r["accuracy"] for r in epochs(tmp_path / "random-classifier" / "metrics.jsonl"))
    print("decoder classifier: pretrained", pretrained, "random start", random_start)
    assert pretrained >= MAJORITY + DECODER_MARGIN and random_start <= pretrained, (pretrained, random_start)
    done = run([sys.executable, "-m", "tpzoo.convert", "to-hf", "gpt-classifier/best", str(tmp_path / "hf")], docs_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    import transformers

    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")  # the padding it was fine-tuned with
    assert config.architectures == [DECODER_CLASSIFIER.architecture] and config.pad_token_id is not None, config


def sft_answers(folder: str, prompts: list[str]) -> list[str]:
    """The fine-tuned model's greedy answers (up to its end-of-document token) to ``prompts``, plain template."""
    from tpzoo.checkpoint import load_model
    from tpzoo.checkpoint.tokenizer import model_tokenizer
    from tpzoo.generate import generate
    from tpzoo.parallel import init_mesh

    model, tok = load_model(folder, init_mesh()).eval(), model_tokenizer(folder)
    out = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt + "\n")])
        new = generate(model, ids, 8, eos_id=tok.eod)[0, ids.shape[1]:].tolist()
        out.append(tok.decode(new[:new.index(tok.eod)] if tok.eod in new else new).strip())
    return out


def test_instruction_tuning_learns_the_answers(docs_dir):
    """The instruction-tuning command: the answers' validation loss falls by epoch and ends below SFT_LOSS, and the
    model answers validation prompts in the taught words (greedy), mostly rightly."""
    from tpzoo.data.demo import ANSWERS

    scores = epochs(docs_dir / "gpt-sft" / "metrics.jsonl")
    print("SFT", [(r["epoch"], r["val_loss"]) for r in scores])
    assert scores[-1]["val_loss"] < scores[0]["val_loss"] and scores[-1]["val_loss"] < SFT_LOSS, scores
    rows = [json.loads(line) for line in (docs_dir / "demo_files" / "instructions_valid.jsonl").read_text().splitlines()]
    answers = spawn(sft_answers, 1, str(docs_dir / "gpt-sft" / "best"), [r["prompt"] for r in rows[:24]])[0]
    print("answers", answers)
    assert set(answers) <= set(ANSWERS), answers
    assert sum(a == r["response"] for a, r in zip(answers, rows)) > len(answers) // 2, answers


def test_lora_trains_the_adapters_alone_and_saves_them_alone(docs_dir):
    """The LoRA command: its validation loss ends below its first logged training loss (the pretrained model's on
    this data, 10 steps in); its checkpoint holds the adapters alone, names the checkpoint they adapt and loads
    with them (frozen base, adapters on)."""
    lines = metrics(docs_dir / "gpt-lora" / "metrics.jsonl")
    full = epochs(docs_dir / "gpt-demo" / "metrics.jsonl")
    print("LoRA", [(r["iteration"], r.get("loss"), r.get("val_loss")) for r in lines], "full",
          [(r["epoch"], r["val_loss"]) for r in full])
    assert lines[-1]["val_loss"] < lines[0]["loss"] - 0.2, lines
    out = spawn(load_lora, 2, str(docs_dir / "gpt-lora" / "best"))[0]
    assert out["adapters"]["rank"] == 8 and out["base"] == str((docs_dir / "gpt-pretrained").resolve())
    assert out["trained"] and all("lora_" in name for name in out["trained"])


def test_to_hf_of_finetuned_checkpoints(docs_dir):
    """python -m tpzoo.convert to-hf: a classifier's Hugging Face config names its classes as the checkpoint
    records them (not LABEL_0 ...); a LoRA checkpoint's adapters are merged (a plain model Hugging Face opens);
    the tokenizer the run recorded (the demo sentencepiece model) is written beside them: AutoTokenizer opens the
    folder and encodes the demo texts into tpzoo's ids."""
    import transformers

    from tpzoo.data import demo_files
    from tpzoo.data.demo import DEMO_TOKENIZER
    from tpzoo.data.tokenizer import load_tokenizer

    for source in ("bert-demo/best", "gpt-lora/best"):
        done = run([sys.executable, "-m", "tpzoo.convert", "to-hf", source, f"{source.split('/')[0]}-hf"], docs_dir)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "with its tokenizer (tokenizer.json, tokenizer_config.json" in done.stdout, done.stdout
    hf_config = transformers.AutoConfig.from_pretrained(docs_dir / "gpt-lora-hf")
    ours, theirs = load_tokenizer(DEMO_TOKENIZER), transformers.AutoTokenizer.from_pretrained(docs_dir / "gpt-lora-hf")
    texts = [json.loads(line)["text"] for line in Path(demo_files("text")[0]).read_text().splitlines()[:100]]
    texts += ["  spaces   between  ", "Ünïcödé — dashes…\nnew\tline", "", "ＦＵＬＬ width ①"]
    assert [theirs.encode(t, add_special_tokens=False) for t in texts] == [ours.encode(t) for t in texts]
    assert theirs.eos_token == "<eod>" and theirs.pad_token == "[PAD]" and theirs.model_max_length == hf_config.n_positions
    config = transformers.AutoConfig.from_pretrained(docs_dir / "bert-demo-hf")
    meta = json.loads(next((docs_dir / "bert-demo" / "best").glob("meta.json")).read_text())
    assert config.id2label == dict(enumerate(meta["label_names"])) and meta["label_names"] != ["LABEL_0", "LABEL_1"]
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(docs_dir / "gpt-lora-hf", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    import peft  # the doc's --peft folder over its base weights: the merged model's logits

    base = transformers.AutoModelForCausalLM.from_pretrained(docs_dir / "gpt-lora-base")
    unmerged = peft.PeftModel.from_pretrained(base, docs_dir / "gpt-lora-peft").eval()
    ids = torch.tensor([ours.encode(texts[0])[:16]])
    with torch.no_grad():
        expected, got = merged.eval()(ids).logits, unmerged(ids).logits
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


def load_lora(folder: str) -> dict:
    from tpzoo.checkpoint import load_model, read_meta
    from tpzoo.parallel import init_mesh

    model = load_model(folder, init_mesh(tp=2))
    record = read_meta(folder)["checkpoint"]["model"]
    return {"adapters": model.adapters, "base": record["adapters_of"],
            "trained": [n for n, p in model.named_parameters() if p.requires_grad]}


def load_best(folder: str) -> dict:
    from tpzoo.checkpoint import load_model, read_meta
    from tpzoo.parallel import init_mesh

    model = load_model(folder, init_mesh(tp=2))
    return {"class": type(model).__name__, "num_labels": model.config.num_labels, "meta": read_meta(folder)}


def test_best_checkpoint_is_the_best_epoch_and_loads(docs_dir):
    save = docs_dir / "bert-demo"
    scores = epochs(save / "metrics.jsonl")
    best = max(scores, key=lambda r: (r["accuracy"], -r["epoch"]))  # ties keep the earlier epoch
    assert (save / "best").is_symlink() and os.readlink(save / "best") == f"iter_{best['iteration']:07d}"
    assert (save / "latest").read_text().strip() == f"iter_{scores[-1]['iteration']:07d}"
    assert sorted(p.name for p in save.glob("iter_*")) == sorted({f"iter_{r['iteration']:07d}"
                                                                  for r in (best, scores[-1])})
    out = spawn(load_best, 2, str(save / "best"))[0]
    assert out["class"] == CLASSIFIER.model and out["num_labels"] == 2
    assert out["meta"]["epoch"] == best["epoch"] and out["meta"]["scores"]["accuracy"] == best["accuracy"]


PAIRS = [("The meal was great.", "The room was lovely.", 1), ("The film was awful.", "The soup was not great.", 0),
         ("The book was not bad.", "The meal was fine.", 1), ("The room was boring.", "The film was dull.", 0)]


def write_pairs(path: Path, n: int, offset: int) -> None:
    rows = [dict(zip(("text", "text_b", "label"), PAIRS[(i + offset) % len(PAIRS)])) for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_pairs_from_files_same_numbers_at_tp1_and_tp2(docs_dir, tmp_path):
    """Sentence pairs (text_b) from jsonl files: torchrun tp=2 logs what tp=1 logs, within float noise:
    1e-5 relative at the first step (same weights, same batch), then 5e-3 (AdamW's eps 1e-8 lets
    summation-order noise of tiny gradients grow a little with every step: 3e-5 at step 10, 1e-3
    at step 16 measured). 38 training pairs = 4 batches of 10, the last padded; four distinct
    pairs, learnt by heart."""
    write_pairs(tmp_path / "train.jsonl", 38, 0)
    write_pairs(tmp_path / "valid.jsonl", 13, 1)
    flags = ["finetune.py", "--load", str(docs_dir / "bert-pretrained"), "--train-data", "train.jsonl",
             "--valid-data", "valid.jsonl", "--epochs", "4", "--seq-length", "24", "--global-batch-size", "10",
             "--micro-batch-size", "5", "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--log-interval", "1", "--lr-warmup-iters", "0",
             "--lr-decay-style", "constant"]
    (tmp_path / "finetune.py").symlink_to(ROOT / "finetune.py")
    runs = {"tp1": [sys.executable, *flags, "--log-dir", "tp1"],
            "tp2": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *flags, "--tp", "2",
                    "--log-dir", "tp2"]}
    run_as_needed([shlex.join(command) for command in runs.values()], tmp_path)  # both at once
    one, two = (metrics(tmp_path / name / "metrics.jsonl") for name in runs)
    assert [r["iteration"] for r in one] == [r["iteration"] for r in two] == list(range(1, 17))
    worst = 0.0
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "val_loss", "accuracy", "f1"):
            if key in a:
                worst = max(worst, abs(a[key] - b[key]) / max(abs(a[key]), 1e-3))
                tol = 1e-5 if a["iteration"] == 1 else 5e-3
                assert abs(a[key] - b[key]) <= tol * max(abs(a[key]), 1e-3), (key, a, b)
    print("tp=2 vs tp=1, largest relative difference:", worst, "accuracy per epoch:",
          [(r["accuracy"], r["val_loss"]) for r in one if "accuracy" in r])
    scores = [r for r in one if "epoch" in r]
    assert scores[-1]["val_loss"] < scores[0]["val_loss"] and scores[-1]["accuracy"] > 0.9, scores


def test_sparse_labels_auto_seq_length_and_the_saved_mapping(docs_dir, tmp_path):
    """Paragraphs of the standard library's documentation (one line each, up to 500 characters) labelled
    by topic 1 2 3 5 7 8: finetune.py says 6 classes, picks --seq-length auto (the training samples'
    95th percentile length) and reports the samples it cuts; the first loss is that of a fresh 6-way
    head, about ln 6 (measured 1.78 to 1.80; a 9-way head of classes 0..8 starts near ln 9 = 2.197); the best
    checkpoint records the label names, and data read for it maps through them."""
    from tpzoo.checkpoint import read_meta
    from tpzoo.data.tokenizer import load_tokenizer
    from tpzoo.training.finetune_setup import finetune_data, saved_model

    rows = stdlib_paragraphs(max_chars=500)
    train, valid = rows[::3], rows[1::6]  # every topic in both
    write_labelled(tmp_path / "train.jsonl", train)
    write_labelled(tmp_path / "valid.jsonl", valid)
    done = run([sys.executable, str(ROOT / "finetune.py"), "--load", str(docs_dir / "bert-pretrained"),
                "--train-data", "train.jsonl", "--valid-data", "valid.jsonl", "--seq-length", "auto", "--epochs", "1",
                "--global-batch-size", "16", "--micro-batch-size", "8", "--log-interval", "1", "--save", "ft"],
               tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    tok = load_tokenizer(docs_dir / "demo_files" / "tokenizer.model")
    lengths = sorted(len(tok.encode(text)) + 2 for text, _ in train)  # [CLS] text [SEP]
    pick = lengths[math.ceil(0.95 * len(lengths)) - 1]
    over = sum(n > pick for n in lengths)
    assert pick < 256 and "\n6 classes: 1 2 3 5 7 8\n" in done.stdout
    assert f"\n--seq-length auto: {pick} (the training samples' 95th percentile length is {pick}; " in done.stdout
    trained = read_meta(docs_dir / "bert-pretrained")["args"]["seq_length"]
    assert f"\n--seq-length {pick} is longer than the {trained} tokens --load was trained on" in done.stdout
    assert (f"; {over} ({over / len(lengths):.1%}) longer than --seq-length {pick} are cut\n") in done.stdout
    assert done.stdout.count(f"training samples: {len(train)}, tokens p50 ") == 1
    first = metrics(tmp_path / "ft" / "metrics.jsonl")[0]
    assert first["iteration"] == 1 and abs(first["loss"] - math.log(6)) < 0.1, first
    meta = read_meta(tmp_path / "ft" / "best")
    assert meta["label_names"] == ["1", "2", "3", "5", "7", "8"] and meta["args"]["seq_length"] == pick

    subset = [(text, label) for text, label in rows if label in (2, 7)]  # two of the six topics
    args = argparse.Namespace(load=str(tmp_path / "ft" / "best"), task=None, seq_length=64, tp=1,
                              sequence_parallel=False, train_data=write_labelled(tmp_path / "sub.jsonl", subset),
                              valid_data=str(tmp_path / "sub.jsonl"))
    _, config, meta = saved_model(args.load)
    data, _, names, _ = finetune_data(args, "classification", tok, config, meta)
    assert names == meta["label_names"] and {e.label for e in data.examples} == {1, 4}


MISUSE = [
    ([], "--load is required"),
    (["--load", "missing-dir", "--task", "demo"], "missing-dir does not exist"),
    (["--load", "bert-pretrained", "--train-data", "ask.jsonl", "--valid-data", "ask.jsonl"],
     "has instructions, but the"),
    (["--load", "bert-pretrained"], "no data: pass --task NAME or --train-data FILE --valid-data FILE"),
    (["--load", "bert-pretrained", "--task", "demo", "--train-data", "x.jsonl"], "either --task or"),
    (["--load", "bert-pretrained", "--train-data", "demo_files/sentiment_train.jsonl"], "go together"),
    (["--load", "bert-pretrained", "--train-data", "nolabel.jsonl", "--valid-data", "nolabel.jsonl"],
     "has no column 'label'"),
    (["--load", "bert-demo/best", "--train-data", "three.jsonl", "--valid-data", "three.jsonl"],
     "has labels ['2'] that the classifier --load bert-demo/best was not fine-tuned on (its labels: ['0', '1'])"),
    (["--load", "bert-demo/best", "--task", "mnli", "--data-dir", "mnli"], "is a classifier of 2 labels but the data "
     "has 3"),
    (["--load", "bert-pretrained", "--task", "demo", "--seq-length", "0"], "expected an integer >= 1 or 'auto'"),
    (["--load", "bare-tpzoo", "--task", "demo"], "bare-tpzoo names no tokenizer and holds none; pass --tokenizer-model"),
    (["--load", "gpt-pretrained", "--train-data", "nolabel.jsonl", "--valid-data", "missing.jsonl"],
     "missing.jsonl' does not exist"),
]


def test_misuse_one_line_exit_2(docs_dir, capsys, monkeypatch):
    """Every misuse fails before the process group starts: run main() in this process, and one
    case as a real command (one line on stderr, no traceback)."""
    (docs_dir / "nolabel.jsonl").write_text('{"text": "a b"}\n')
    (docs_dir / "ask.jsonl").write_text('{"prompt": "a b?", "response": "c"}\n')
    (docs_dir / "three.jsonl").write_text("".join(json.dumps({"text": "a", "label": y}) + "\n" for y in (0, 1, 2)))
    (docs_dir / "mnli").mkdir(exist_ok=True)
    for name in ("train.tsv", "dev_matched.tsv"):
        (docs_dir / "mnli" / name).write_text("sentence1\tsentence2\tgold_label\nIt rains.\tIt is dry.\tneutral\n")
    (docs_dir / "bare-tpzoo").mkdir(exist_ok=True)  # a model folder without the tokenizer files
    for name in ("config.json", "model.safetensors"):
        (docs_dir / "bare-tpzoo" / name).write_bytes((docs_dir / "bert-hf-tpzoo" / name).read_bytes())
    monkeypatch.chdir(docs_dir)
    for flags, message in MISUSE:
        monkeypatch.setattr(sys, "argv", ["finetune.py", *flags])
        with pytest.raises(SystemExit) as info:
            runpy.run_path(str(ROOT / "finetune.py"), run_name="__main__")
        err = capsys.readouterr().err
        assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, (flags, err)
    done = run([sys.executable, "finetune.py", *MISUSE[2][0]], docs_dir)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("finetune.py: error:")
