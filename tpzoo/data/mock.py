"""``--mock-data`` (Megatron-LM's mock datasets): random documents of the tokenizer's ordinary ids
(never a special one), written once as an indexed dataset in the data cache, so that GPT windows and
BERT samples are read from it exactly as from real data.

    prefix = mock_prefix("masked-lm", tokenizer, seed=1234)   # the same files for the same arguments

Document d holds ``MOCK_TOKENS`` tokens on average: lengths and ids come from a generator seeded by
``seed`` alone, so every rank and every launch builds the same data. Causal-LM documents end with the
tokenizer's eod; masked-LM documents are split into sentences of 4 to 32 tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tpzoo.data.cache import cached_build
from tpzoo.data.indexed import IndexedDatasetBuilder
from tpzoo.data.tokenizer import Tokenizer

MOCK_DOCUMENTS = 2048
MOCK_TOKENS = 256  # mean document length


def mock_documents(kind: str, tokenizer: Tokenizer, seed: int, num_documents: int = MOCK_DOCUMENTS
                   ) -> list[tuple[np.ndarray, list[int] | None]]:
    """``num_documents`` random documents (int32 tokens, sentence lengths or None) of data ``kind``
    ("causal-lm": eod-terminated; "masked-lm": sentences). ValueError when the tokenizer lacks what
    the kind needs or has no ordinary id."""
    special = set(tokenizer.special_ids)
    if kind == "causal-lm" and tokenizer.eod is None:
        raise ValueError(f"--mock-data for a causal LM needs an end-of-document token; {tokenizer.path} has none")
    if kind == "masked-lm" and None in (tokenizer.cls, tokenizer.sep, tokenizer.mask):
        raise ValueError(f"--mock-data for a masked LM needs [CLS], [SEP] and [MASK] ids; {tokenizer.path} lacks "
                         "them: use a BERT vocabulary (--vocab-file vocab.txt)")
    ordinary = np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int32)
    if not len(ordinary):
        raise ValueError(f"{tokenizer.path} has no ordinary token to draw mock data from")
    gen = np.random.default_rng([seed, 0x6D6F636B])  # "mock"
    docs = []
    for _ in range(num_documents):
        n = int(gen.integers(MOCK_TOKENS // 2, 3 * MOCK_TOKENS // 2))
        tokens = ordinary[gen.integers(0, len(ordinary), n)]
        if kind == "causal-lm":
            docs.append((np.append(tokens, np.int32(tokenizer.eod)), None))
        else:
            cuts = np.cumsum(gen.integers(4, 33, n // 4 + 1))
            cuts = cuts[cuts < n]
            docs.append((tokens, np.diff(np.concatenate([[0], cuts, [n]])).tolist()))
    return docs


def mock_prefix(kind: str, tokenizer: Tokenizer, seed: int, cache_path: str | None = None) -> str:
    """The indexed-dataset prefix of the mock data of ``kind`` for ``tokenizer`` and ``seed``, built in
    ``cache_dir(cache_path)/mock/`` the first time."""
    name = f"mock/{kind}-{tokenizer.sha256[:16]}-{seed}"

    def build(out: Path) -> None:
        with IndexedDatasetBuilder(str(out / "data"), tokenizer.vocab_size) as builder:
            for tokens, lengths in mock_documents(kind, tokenizer, seed):
                builder.add_document(tokens, lengths)
            builder.finalize({"tokenizer": tokenizer.reference(), "append_eod": kind == "causal-lm",
                              "split_sentences": kind == "masked-lm", "mock": True})

    return str(cached_build(name, build, cache_path) / "data")
