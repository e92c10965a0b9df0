"""The standard library's docstrings as a labelled task (tpzoo.data.stdlib_docs) and the naive Bayes baseline
(bench/naive_bayes.py) that docs/finetuning.md's recipe beats: on a small library made in the test (read, not
imported) and on this Python's own."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from doc_helpers import ROOT

from tpzoo.data import stdlib_docs
from tpzoo.data.__main__ import main as data_main

pytestmark = pytest.mark.tier("unit")

sys.path.insert(0, str(ROOT / "bench"))
from naive_bayes import NaiveBayes, main as naive_bayes  # noqa: E402


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def library(root: Path) -> Path:
    """socket.py and threading.py with 10 docstrings each (two the same), os/path.py in a package, a test
    folder and a file that is not Python 3."""
    for module, word in (("socket", "connection"), ("threading", "lock")):
        functions = "".join(f'def f{i}():\n    """The {word} number {i % 9} of this\n    module, on two lines."""\n'
                            for i in range(10))
        (root / f"{module}.py").write_text(f'"""The {module} module: about {word}s, at length."""\n{functions}')
    (root / "os").mkdir()
    (root / "os" / "path.py").write_text('class P:\n    """Paths: joined, split, normalised, made absolute."""\n')
    (root / "test").mkdir()
    (root / "test" / "test_socket.py").write_text('"""A test module that no task may read, however long."""\n')
    (root / "old.py").write_text('print "not Python 3"\n')
    return root


def test_export_labels_by_family_and_keeps_validation_out_of_the_corpus(tmp_path):
    (tmp_path / "lib").mkdir()
    root = library(tmp_path / "lib")
    texts = list(stdlib_docs.docstrings(root))
    assert {m for m, _ in texts} == {"socket", "threading", "os"} and all("\n" not in t for _, t in texts)
    assert ("threading", "The lock number 0 of this module, on two lines.") in texts
    counts = stdlib_docs.export(tmp_path / "out", per_class=3, root=root)
    corpus, train, valid = (read(tmp_path / "out" / f"{n}.jsonl") for n in ("corpus", "train", "valid"))
    unique = {t for _, t in texts}
    assert counts == {"corpus": len(corpus), "train": len(train), "valid": len(valid)}
    assert len(corpus) + len(valid) == len(unique) == 21  # 9 distinct per module + 2 module docstrings + 1 class
    assert {r["text"] for r in corpus}.isdisjoint(r["text"] for r in valid) and valid
    assert {r["label"] for r in train} <= {"network", "concurrency", "files"} and len(train) <= 9
    assert all(r["label"] == stdlib_docs.FAMILY_OF[m] for m, t in texts for r in train + valid if r["text"] == t)
    assert stdlib_docs.export(tmp_path / "again", per_class=3, root=root) == counts
    assert (tmp_path / "again" / "train.jsonl").read_bytes() == (tmp_path / "out" / "train.jsonl").read_bytes()
    with pytest.raises(ValueError, match="no docstring of the families' modules"):
        stdlib_docs.export(tmp_path / "none", root=tmp_path / "out")


def test_this_pythons_library_gives_every_family_and_the_baseline_beats_the_majority(tmp_path, capsys):
    assert data_main(["stdlib", "--export", str(tmp_path), "--per-class", "30"]) == 0
    counts = json.loads(capsys.readouterr().out)
    train, valid = read(tmp_path / "train.jsonl"), read(tmp_path / "valid.jsonl")
    assert {r["label"] for r in train} == {r["label"] for r in valid} == set(stdlib_docs.FAMILIES)
    assert counts["train"] == 30 * len(stdlib_docs.FAMILIES) and counts["corpus"] > 3000 and counts["valid"] > 400
    assert naive_bayes(["--train-data", str(tmp_path / "train.jsonl"), "--valid-data", str(tmp_path / "valid.jsonl")]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["classes"] == 7 and scores["accuracy"] > scores["majority_class"] + 0.1, scores


def test_naive_bayes_counts_words_with_add_one_smoothing():
    model = NaiveBayes([("socket socket send", 0), ("lock thread", 1), ("thread start", 1)])
    assert model.vocab == {"socket", "send", "lock", "thread", "start"}
    # P(socket | 0) = (2 + 1) / (3 + 5); P(socket | 1) = (0 + 1) / (4 + 5); priors 1/3 and 2/3
    assert model.score("Socket unknown", 0) == pytest.approx(math.log(1 / 3 * 3 / 8))
    assert model.predict("socket") == 0 and model.predict("thread") == 1 and model.predict("unseen words") == 1


def test_naive_bayes_refuses_a_file_without_labels_in_one_line(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text('{"text": "a"}\n')
    assert naive_bayes(["--train-data", str(tmp_path / "t.jsonl"), "--valid-data", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no column 'label'" in err, err
