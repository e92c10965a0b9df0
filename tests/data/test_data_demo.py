"""The bundled demo: built quickly on first use, the same bytes everywhere, learnable, packaged."""

import hashlib
import multiprocessing as mp
import re
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from families import MASKED_LM

from tpzoo.data import demo
from tpzoo.data.cache import cached_build
from tpzoo.data.indexed import IndexedDataset
from tpzoo.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.tier("unit")



# The same bytes on every machine: the generator uses only random.Random.random().
SHA256 = {
    "corpus.jsonl": "5dedb292fa3b54f8c520cb6fa6244bd8d3b86634ccb04abec5330031824becf7",
    "gpt.bin": "add0a0d8a270d2b2367afcf978afd0c910b39b9a9a1e23c83690c07791ade537",
    "bert.bin": "97af98c62ef1c0e596c842717565e58dc3c779bd6bdf598d34d652bdd7923da9",
    "sentiment_train.jsonl": "5106885f0cf7315e596b2707d6f18bf4d9177b49bfa0b28204844039834ad87e",
    "sentiment_valid.jsonl": "2e90d6e3fcefe4f1fea1721ae85e515cbae83b2c83ae00d0a7b70b50f93e32a5",
}


def test_first_use_build_is_quick_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("TPZOO_CACHE", str(tmp_path))
    start = time.perf_counter()
    tok_path, gpt = demo.demo_data("causal-lm")
    seconds = time.perf_counter() - start
    print(f"demo first-use build: {seconds:.1f} s")
    assert seconds < 20
    folder = Path(gpt).parent
    assert folder.parent == tmp_path and demo.demo_data(MASKED_LM.family)[1] == str(folder / demo.PREFIXES["masked-lm"])
    for name, digest in SHA256.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    start = time.perf_counter()
    assert demo.demo_data("causal-lm") == (tok_path, gpt) and time.perf_counter() - start < 1  # cached


def test_demo_contents():
    tok_path, gpt_prefix = demo.demo_data("causal-lm")
    tok = load_tokenizer(tok_path)
    gpt, bert = IndexedDataset(gpt_prefix), IndexedDataset(demo.demo_data("masked-lm")[1])
    assert tok.vocab_size == 512 and gpt.dtype == np.uint16
    assert gpt.num_documents == bert.num_documents == 12_000 and gpt.num_tokens > 1_000_000
    ends = gpt.tokens[gpt.sequence_pointers[1:] // 2 - 1]
    assert (ends == tok.eod).all() and (gpt.tokens == tok.eod).sum() == 12_000
    assert bert.num_sequences > 10 * bert.num_documents and (bert.tokens != tok.eod).all()
    entropy = demo.unigram_entropy(gpt_prefix, tok.vocab_size)
    print(f"demo corpus: {gpt.num_tokens} tokens, unigram entropy {entropy:.3f} nats/token")
    assert 4.5 < entropy < 6.0
    counts = np.bincount(gpt.tokens, minlength=tok.vocab_size)
    p = counts[counts > 0] / counts.sum()
    assert entropy == float(-(p * np.log(p)).sum())


def test_shipped_tokenizer_is_the_one_the_recipe_trains(tmp_path):
    shipped = load_tokenizer(demo.DEMO_TOKENIZER)
    again = load_tokenizer(demo.train_demo_tokenizer(str(tmp_path / "tok")))
    assert again.pieces() == shipped.pieces()
    assert [again.sp.get_score(i) for i in range(512)] == [shipped.sp.get_score(i) for i in range(512)]


def test_demo_tokenizer_is_package_data():
    config = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert re.search(r"^packages = \[[^\]]*\"tpzoo\.data\"[^\]]*\]", config, re.M)
    section = config.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    patterns = re.findall(r'"([^"]+)"', re.findall(r'^"tpzoo\.data" = \[(.*)\]$', section, re.M)[0])
    assert any(demo.DEMO_TOKENIZER.match("tpzoo/data/" + p) for p in patterns)
    assert demo.DEMO_TOKENIZER.stat().st_size < 1 << 20


def _build_counting(out):
    with open(out.parent / "builds.log", "a") as f:
        f.write("built\n")
    time.sleep(0.3)
    (out / "done").write_text("ok")


def _build_once(_):
    return str(cached_build("race", _build_counting))


@pytest.mark.tier("distributed")
def test_cached_build_runs_once_across_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("TPZOO_CACHE", str(tmp_path))
    with ProcessPoolExecutor(3, mp.get_context("fork")) as pool:
        folders = list(pool.map(_build_once, range(3)))
    assert folders == [str(tmp_path / "race")] * 3 and (tmp_path / "race" / "done").read_text() == "ok"
    assert (tmp_path / "builds.log").read_text() == "built\n"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
