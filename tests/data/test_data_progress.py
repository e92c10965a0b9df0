"""What the data steps say while they run: ``--dataset`` tokenized into ``--data-cache-path`` (and
nowhere else) with the path, the counts and the seconds on stderr, the path again when found in the
cache, the slow samples-index steps on rank 0 only, a bar on a terminal and a few plain lines
elsewhere; and ``--help`` states each data default once."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from real_text import documents, write_jsonl

from tpzoo.data.build import build_datasets, resolve_data
from tpzoo.data.indexed import IndexedDataset
from tpzoo.data.tokenizer import load_tokenizer, train_tokenizer

pytestmark = pytest.mark.tier("unit")



ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Python's standard-library docs (one long line per module) as jsonl, and a tokenizer trained on them."""
    root = tmp_path_factory.mktemp("docs")
    docs = documents()
    path = write_jsonl(root / "stdlib.jsonl", docs)
    return {"file": str(path), "docs": docs, "tokenizer": train_tokenizer(str(path), str(root / "tok"), 800)}


def tokenized(corpus, model: str, cache: Path) -> str:
    """The prefix of ``corpus`` tokenized for ``model`` into the data cache ``cache``."""
    return resolve_data(model, dataset=[corpus["file"]], tokenizer_model=corpus["tokenizer"], cache_path=str(cache))[1]


@pytest.fixture
def no_default_cache(tmp_path, monkeypatch):
    """$TPZOO_CACHE and $HOME point at empty folders: a tpzoo cache there went to the wrong place."""
    monkeypatch.setenv("TPZOO_CACHE", str(tmp_path / "env-cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RANK", raising=False)
    return [tmp_path / "env-cache", tmp_path / "home" / ".cache" / "tpzoo"]


def test_dataset_tokenized_into_cache_path_says_where_and_how_much(corpus, tmp_path, no_default_cache, capsys):
    cache = tmp_path / "my-cache"
    prefix = tokenized(corpus, "causal-lm", cache)
    err = capsys.readouterr().err.splitlines()
    folder = Path(prefix).parent
    assert folder.parent == cache / "datasets" and Path(prefix + ".bin").is_file()
    assert not any(p.exists() for p in no_default_cache)
    data = IndexedDataset(prefix)
    assert data.num_documents == len(corpus["docs"]) > 30
    assert len(err) == 2, err
    size = Path(corpus["file"]).stat().st_size / 1e6
    assert err[0] == f"tokenizing 1 file ({size:.1f} MB) with tok.model into {prefix} (once; later runs reuse it)"
    done = re.fullmatch(r"tokenizing: done, ([\d,]+) documents, ([\d,]+) tokens in [\d.]+ s", err[1])
    assert done and [int(g.replace(",", "")) for g in done.groups()] == [data.num_documents, data.num_tokens], err[1]


def test_dataset_found_in_cache_names_its_path_on_rank_0_only(corpus, tmp_path, no_default_cache, capsys, monkeypatch):
    built = tokenized(corpus, "masked-lm", tmp_path / "my-cache")
    assert "tokenizing" in capsys.readouterr().err
    found = tokenized(corpus, "masked-lm", tmp_path / "my-cache")  # one line, and no tokenizing
    assert found == built
    assert capsys.readouterr().err == f"tokenized dataset: {found} (cached; delete {Path(found).parent} to rebuild)\n"
    monkeypatch.setenv("RANK", "1")
    assert tokenized(corpus, "masked-lm", tmp_path / "my-cache") == found and capsys.readouterr().err == ""


def test_slow_samples_index_steps_report_on_rank_0(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    gpt, bert = tokenized(corpus, "causal-lm", tmp_path), tokenized(corpus, "masked-lm", tmp_path)
    tok = load_tokenizer(corpus["tokenizer"])
    capsys.readouterr()

    def build(rank: str) -> list[str]:
        monkeypatch.setenv("RANK", rank)
        build_datasets("causal-lm", tok, gpt, 64, 1, (5000, 0, 0), "100,0,0")
        build_datasets("masked-lm", tok, bert, 64, 1, (100, 0, 0), "100,0,0")
        return capsys.readouterr().err.splitlines()

    assert build("0") == []  # quicker than QUIET_SECONDS: silent
    monkeypatch.setattr("tpzoo.data.progress.QUIET_SECONDS", 0.0)
    assert build("1") == []
    lines, n = build("0"), len(corpus["docs"])
    assert len(lines) == 4, lines
    assert re.fullmatch(rf"ordering the train documents of {gpt} for 5,000 samples of 64 tokens: \d+ epochs of "
                        rf"{n} documents", lines[0]), lines[0]
    assert re.fullmatch(r"GPT epochs: done, (\d+)/\1 epochs in [\d.]+ s", lines[1]), lines[1]
    assert lines[2] == f"cutting the {n} train documents of {bert} into BERT chunks"
    assert re.fullmatch(rf"BERT chunks: done, {n}/{n} documents in [\d.]+ s", lines[3]), lines[3]


@pytest.mark.parametrize("interactive", [True, False])
def test_progress_is_a_bar_on_a_terminal_and_few_lines_elsewhere(capsys, interactive):
    from tpzoo.data.progress import Progress

    with Progress("tokenizing", "documents", title="tokenizing 3 files into /x", interactive=interactive,
                  delay=0, interval=0.05) as bar:
        for k in range(1, 5):
            time.sleep(0.03)
            bar.update(10, tokens=k * 1000)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == "tokenizing 3 files into /x"
    assert lines[-1].startswith("tokenizing: done, 40 documents, 4,000 tokens in ")
    assert ("documents/s" in err) == interactive, err  # the bar
    plain = [line for line in lines[1:-1] if re.fullmatch(r"tokenizing: \d+ documents, [\d,]+ tokens, \d+ s", line)]
    assert len(plain) == 0 if interactive else 1 <= len(plain) <= 3, lines  # at most one per 0.05 s interval


def test_progress_of_a_quick_or_failed_step_says_nothing_of_it(capsys):
    from tpzoo.data.progress import Progress

    with Progress("quick", "items", 5, title="a quick step", delay=10) as bar:
        for _ in bar.iterate(range(5)):
            pass
    with pytest.raises(ValueError), Progress("failing", "items", title="a failing step", delay=0):
        raise ValueError("before the first item")
    assert capsys.readouterr().err == ""


@pytest.mark.tier("journey")
def test_data_cache_path_flag_and_help(corpus, tmp_path):
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path / "home"),
           "TPZOO_CACHE": str(tmp_path / "env-cache"), "OMP_NUM_THREADS": "1"}
    args = ["inspect", "--dataset", corpus["file"], "--tokenizer-model", corpus["tokenizer"], "--data-cache-path",
            "here"]
    done = subprocess.run([sys.executable, "-m", "tpzoo.data", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "here" / "datasets").glob("gpt-*/data.idx"))
    assert not (tmp_path / "env-cache").exists() and not (tmp_path / "home" / ".cache" / "tpzoo").exists()
    assert "tokenizing 1 file" in done.stderr and str(tmp_path / "here" / "datasets") in done.stderr
    assert done.stdout.startswith("{") and '"documents": ' in done.stdout  # stdout stays the command's JSON
    for command in ([sys.executable, "-m", "tpzoo.data", "samples", "--help"],
                    [sys.executable, "pretrain.py", "--help"]):
        help_text = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120).stdout
        data = " ".join(help_text.split("\ndata:\n", 1)[1].split("\n\n", 1)[0].split())
        assert data.count("98,1,1") == 1 and data.count("default") == 7, data  # --dataset-split, --json-key,
        # --tokenizer-model, --null-tokenizer-pad-id, --split, --mask-prob, --data-cache-path: once each
        assert "--data-cache-path DIR where --dataset files are tokenized and the demo corpus is built, once " \
               "(default: $TPZOO_CACHE, else ~/.cache/tpzoo)" in data, data
