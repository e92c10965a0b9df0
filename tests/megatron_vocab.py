"""Megatron-LM style tokenizer files made by the ``tokenizers`` library from local text (no download):
GPT-2's ``gpt2-vocab.json`` + ``gpt2-merges.txt`` (byte-level BPE with ``<|endoftext|>``) and a BERT
``vocab.txt`` (lower-cased WordPiece), trained on tests/real_text.py's documents; and a jsonl corpus
of those documents with two text keys (``text``, ``title``). Built once per process."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from real_text import documents

GPT2_VOCAB = 600
BERT_VOCAB = 500


@lru_cache(maxsize=None)
def megatron_files() -> dict[str, str]:
    """Paths: ``vocab_json``, ``merges`` (GPT-2 BPE), ``vocab_txt`` (WordPiece), ``corpus`` (jsonl with
    ``text`` and ``title``), ``folder`` (``vocab.json`` + ``merges.txt``: what transformers loads)."""
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer

    root = Path(tempfile.mkdtemp(prefix="tpzoo-megatron-vocab-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    docs = documents()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=GPT2_VOCAB, special_tokens=["<|endoftext|>"], show_progress=False)
    vocab_json, merges = bpe.save_model(str(root), "gpt2")
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(docs, vocab_size=BERT_VOCAB, show_progress=False)
    (vocab_txt,) = wordpiece.save_model(str(root))
    (root / "hf").mkdir()
    shutil.copy(vocab_json, root / "hf" / "vocab.json")
    shutil.copy(merges, root / "hf" / "merges.txt")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d, "title": f"Document {i}. Its title."}) + "\n"
                              for i, d in enumerate(docs)))
    return {"vocab_json": vocab_json, "merges": merges, "vocab_txt": vocab_txt, "corpus": str(corpus),
            "folder": str(root / "hf"), "root": str(root)}
