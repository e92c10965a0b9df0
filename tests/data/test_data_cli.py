"""``python -m tpzoo.data``: every command and snippet of docs/data.md runs, in order; misuse ends
with status 2 and one line on stderr."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import corpus_files, small_corpus

pytestmark = pytest.mark.tier("journey")



DOCS = Path(__file__).parents[2] / "docs" / "data.md"


def run(args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "tpzoo.data", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def doc_blocks():
    """The ``bash`` and ``python`` blocks of docs/data.md, in order."""
    return re.findall(r"```(bash|python)\n(.*?)```", DOCS.read_text(), re.S)


def shape(text: str, home: Path) -> str:
    """``text`` with ``home`` written /home/me, cache keys KEY and numbers N."""
    return re.sub(r"\d[\d,.]*", "N", re.sub(r"\b[0-9a-f]{16}\b", "KEY", text.replace(str(home), "/home/me")))


def test_docs_commands_and_snippets_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TPZOO_CACHE", str(tmp_path / "cache"))  # the demo is built there
    cwd, namespace, outputs, errors = os.getcwd(), {}, {}, {}
    blocks = doc_blocks()
    assert sum(kind == "bash" for kind, _ in blocks) >= 5 and sum(kind == "python" for kind, _ in blocks) >= 4
    try:
        os.chdir(tmp_path)
        for kind, body in blocks:
            if kind == "python":
                exec(compile(body, str(DOCS), "exec"), namespace)
                continue
            for line in body.strip().splitlines():
                args = shlex.split(line)
                assert args[:3] == ["python", "-m", "tpzoo.data"], line
                result = run(args[3:], tmp_path)
                assert result.returncode == 0, f"{line}\n{result.stderr}"
                outputs[args[3] + " " + args[-1]] = result.stdout
                errors[args[3] + " " + args[-1]] = result.stderr
    finally:
        os.chdir(cwd)
    demo = json.loads(outputs["demo demo_files"])
    assert demo["unigram_entropy_nats"] == pytest.approx(5.19, abs=0.01)
    assert {p.name for p in (tmp_path / "demo_files").iterdir()} == {"corpus.jsonl", "tokenizer.model"} | {
        f"{kind}_{split}.jsonl" for kind in ("sentiment", "text", "instructions") for split in ("train", "valid")}
    stats = [json.loads(o) for k, o in outputs.items() if k.startswith("preprocess")]
    assert [s["documents"] for s in stats] == [12_000, 12_000] and stats[0]["tokens"] > 1_000_000
    gpt_samples = [json.loads(line) for line in outputs["samples 1"].splitlines()]
    assert [s["index"] for s in gpt_samples] == [0, 1] and len(gpt_samples[0]["input"]) > 50
    bert = json.loads(outputs["samples nsp"])
    assert bert["tokens"].startswith("[CLS]") and bert["masked"] and bert["next_sentence_label"] in (0, 1)
    assert namespace["batch"][0]["labels"].shape == (32,)
    assert len([p for p in (tmp_path / "data_cache" / "datasets").iterdir() if p.is_dir()]) == 1
    assert not (tmp_path / "cache" / "datasets").exists()  # --data-cache-path, not $TPZOO_CACHE
    built, found = re.findall(r"```text\n(.*?)```", DOCS.read_text(), re.S)  # what the docs say they print
    assert shape(errors["samples data_cache"], tmp_path) == shape(built, Path("/home/me"))
    assert shape(errors["inspect data_cache"], tmp_path) == shape(found, Path("/home/me"))


MISUSE = [
    (
        ["preprocess", "--input", "missing.jsonl", "--output-prefix", "o", "--tokenizer-model", "{tok}"],
        "input file 'missing.jsonl' does not exist",
    ),
    (
        [
            "preprocess",
            "--input",
            "{jsonl}",
            "--output-prefix",
            "o",
            "--tokenizer-model",
            "{tok}",
            "--json-key",
            "body",
        ],
        "key 'body' is not in",
    ),
    (
        ["preprocess", "--input", "empty.jsonl", "--output-prefix", "o", "--tokenizer-model", "{tok}"],
        "the corpus is empty",
    ),
    (
        ["train-tokenizer", "--input", "{jsonl}", "--model-prefix", "t", "--vocab-size", "4"],
        "vocab_size=4 leaves no room beside the 6 special tokens",
    ),
    (["samples", "--data-path", "data", "--tokenizer-model", "other.model"], "was tokenized with"),
    (["samples", "--data-path", "data", "--split", "1,x"], "--split '1,x' must be up to three"),
    (["samples", "--data-path", "nope"], "nope.bin and nope.idx not found"),
    (["preprocess", "--input", "{jsonl}"], "the following arguments are required: --output-prefix"),
    (["samples", "--model", "t5"], "argument --model: unknown model family 't5'; known: gpt"),
]


def test_misuse_exits_2_with_one_line(tmp_path):
    from tpzoo.data.preprocess import preprocess
    from tpzoo.data.tokenizer import train_tokenizer

    tok = small_corpus()["tokenizer"]
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    preprocess(corpus_files()[0], str(tmp_path / "data"), tok, append_eod=True, progress=False)
    train_tokenizer(corpus_files(), str(tmp_path / "other"), 280)
    for args, message in MISUSE:
        args = [a.format(tok=tok, jsonl=corpus_files()[0]) for a in args]
        result = run(args, tmp_path)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert lines[0].startswith("python -m tpzoo.data") and message in lines[0], (message, lines[0])
    assert not list(tmp_path.glob("o.*"))
