"""Shared inputs of the tpzoo.data tests: a small generated corpus in several file formats and a
tokenizer trained on it, built once per process."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from tpzoo.data import grammar
from tpzoo.data.tokenizer import train_tokenizer


@lru_cache(maxsize=None)
def small_corpus() -> dict[str, str]:
    """Paths: ``jsonl``/``json``/``txt``/``parquet`` files of one 160-document corpus (in that
    order when concatenated: 40 documents each), and ``tokenizer`` (a 300-piece BPE over them)."""
    import pandas as pd

    root = Path(tempfile.mkdtemp(prefix="tpzoo-data-test-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    docs = grammar.corpus(160, seed=7)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:40])))
    (root / "b.json").write_text(json.dumps([{"text": d} for d in docs[40:80]]))
    (root / "c.txt").write_text("\n\n".join(d.replace(". ", ".\n") for d in docs[80:120]) + "\n")
    pd.DataFrame({"text": docs[120:]}).to_parquet(root / "d.parquet")
    files = [str(root / n) for n in ("a.jsonl", "b.json", "c.txt", "d.parquet")]
    tok = train_tokenizer(files, str(root / "tok"), 300)
    return {"root": str(root), "docs": json.dumps(docs), "files": json.dumps(files), "tokenizer": tok}


def corpus_docs() -> list[str]:
    return json.loads(small_corpus()["docs"])


def corpus_files() -> list[str]:
    return json.loads(small_corpus()["files"])
