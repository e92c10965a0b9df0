"""Tokenize a corpus with worker processes into an indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Documents stream from the files in order; batches go to ``workers`` processes and come back in
order, so the output is the same for any number of workers. ``megatron_prefix`` names the files as
Megatron-LM's tools/preprocess_data.py does (``PREFIX_{key}_document``, ``_sentence`` when split).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import re
import time
from collections import deque
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from tpzoo.data.indexed import IndexedDatasetBuilder
from tpzoo.data.progress import Progress, say
from tpzoo.data.sources import check_key, iter_documents, resolve_files
from tpzoo.data.tokenizer import Tokenizer, load_tokenizer

# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket) before whitespace.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+")

_state: dict[str, Any] = {}


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Split ``text`` into sentences: at every line break, and after . ! ? followed by whitespace.
    ``keep_newlines``: the last sentence of each line but the last keeps its line break."""
    lines = text.splitlines()
    out = []
    for k, line in enumerate(lines):
        sentences = [s for s in _SENTENCE_END.split(line.strip()) if s]
        if keep_newlines and sentences and k < len(lines) - 1:
            sentences[-1] += "\n"
        out += sentences
    return out


def megatron_prefix(output_prefix: str, key: str, sentences: bool) -> str:
    """Megatron-LM's output prefix of the json key ``key``: ``PREFIX_{key}_document`` (``_sentence``)."""
    return f"{output_prefix}_{key}_{'sentence' if sentences else 'document'}"


def _init_worker(tokenizer: Tokenizer, append_eod: bool, sentences: bool, keep_newlines: bool = False) -> None:
    _state.update(tok=tokenizer, append_eod=append_eod, sentences=sentences, keep_newlines=keep_newlines)


def _encode(texts: list[str]) -> list[tuple[np.ndarray, list[int] | None]]:
    """Encode a batch of documents: for each, (int32 tokens, sentence lengths or None)."""
    tok, eod, sentences = _state["tok"], _state["append_eod"], _state["sentences"]
    if sentences:  # one encode call for every sentence of the batch, then regrouped by document
        split = [split_sentences(t, _state["keep_newlines"]) or [""] for t in texts]
        flat = iter(tok.encode_batch([s for doc in split for s in doc]))
        docs = [[next(flat) for _ in doc] for doc in split]
    else:
        docs = [[d] for d in tok.encode_batch(texts)]
    out = []
    for pieces in docs:
        if eod:
            pieces[-1] = pieces[-1] + [tok.eod]
        lengths = [len(p) for p in pieces]
        out.append(
            (np.fromiter(itertools.chain.from_iterable(pieces), np.int32, sum(lengths)), lengths if sentences else None)
        )
    return out


def _batches(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(docs)
    while batch := list(itertools.islice(it, size)):
        yield batch


def _ordered_map(pool: Executor, fn: Callable, items: Iterable, depth: int) -> Iterator:
    """``map(fn, items)`` on ``pool``, in order, with at most ``depth`` items in flight (so the
    input is read no faster than it is consumed)."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def preprocess(
    inputs: str | Iterable[str],
    output_prefix: str,
    tokenizer: Tokenizer | str,
    json_key: str = "text",
    workers: int = 1,
    append_eod: bool = False,
    split_sentences: bool = False,
    batch_size: int = 64,
    progress: bool = True,
    title: str | None = None,
    keep_newlines: bool = False,
    log_interval: int | None = None,
) -> dict[str, float]:
    """Tokenize ``inputs`` (json/jsonl/txt/parquet/csv/tsv files, globs or folders) into
    ``output_prefix.bin/.idx``. ``append_eod`` ends every document with the end-of-document id
    (GPT); ``split_sentences`` stores each sentence as a sequence (BERT), ``keep_newlines`` keeping
    the line breaks between them. ``progress`` shows the ``title`` line (default: what is tokenized
    into where), the count and a done line on stderr; ``log_interval`` also a line every that many
    documents. Returns counts and speed: ``documents, sequences, tokens, seconds, tokens_per_sec``.
    """
    files = resolve_files(inputs)
    for path in files:
        check_key(path, json_key)
    title = title or f"tokenizing {describe_files(files)} into {output_prefix}.bin/.idx"
    return write_indexed(
        iter_documents(files, json_key),
        output_prefix,
        tokenizer,
        workers,
        append_eod,
        split_sentences,
        batch_size,
        progress,
        {"json_key": json_key, "inputs": [os.path.abspath(f) for f in files]},
        title,
        keep_newlines,
        log_interval,
    )


def describe_files(files: list[str]) -> str:
    """``"2 files (12.3 MB)"``."""
    size = sum(os.path.getsize(f) for f in files)
    return f"{len(files):,} file{'s' * (len(files) != 1)} ({size / 1e6:,.1f} MB)"


def write_indexed(
    documents: Iterable[str],
    output_prefix: str,
    tokenizer: Tokenizer | str,
    workers: int = 1,
    append_eod: bool = False,
    split_sentences: bool = False,
    batch_size: int = 64,
    progress: bool = True,
    metadata: dict[str, Any] | None = None,
    title: str | None = None,
    keep_newlines: bool = False,
    log_interval: int | None = None,
) -> dict[str, float]:
    """Tokenize the texts ``documents`` into ``output_prefix.bin/.idx`` (as ``preprocess`` does);
    ``metadata`` joins the tokenizer reference and options in the index."""
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    if append_eod and tok.eod is None:
        raise ValueError(f"tokenizer {tok.path!r} has no end-of-document token; drop --append-eod or use another")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    start = time.perf_counter()
    init = (tok, append_eod, split_sentences, keep_newlines)  # pickled to workers as its options
    pool = ProcessPoolExecutor(workers, mp.get_context("spawn"), _init_worker, init) if workers > 1 else None
    try:
        if pool is None:
            _init_worker(*init)
        batches = _batches(documents, batch_size)
        results = _ordered_map(pool, _encode, batches, 4 * workers) if pool else map(_encode, batches)
        with (
            IndexedDatasetBuilder(output_prefix, tok.vocab_size) as builder,
            Progress("tokenizing", "documents", title=title, enabled=progress, delay=0) as bar,
        ):
            for batch in results:
                for tokens, lengths in batch:
                    builder.add_document(tokens, lengths)
                    if log_interval and builder.num_documents % log_interval == 0:
                        elapsed = time.perf_counter() - start
                        say(f"processed {builder.num_documents:,} documents ({builder.num_documents / elapsed:,.0f} "
                            f"docs/s, {builder.num_tokens / elapsed:,.0f} tokens/s)")
                bar.update(len(batch), tokens=builder.num_tokens)
            if builder.num_tokens == 0:
                raise ValueError(f"the corpus is empty: no document has any text ({metadata or {}}); check the input")
            bar.stage(f"writing the index ({builder.num_sequences:,} sequences)")
            builder.finalize(
                {
                    "tokenizer": tok.reference(),
                    "append_eod": append_eod,
                    "split_sentences": split_sentences,
                    **(metadata or {}),
                }
            )
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    seconds = time.perf_counter() - start
    return {
        "documents": builder.num_documents,
        "sequences": builder.num_sequences,
        "tokens": builder.num_tokens,
        "seconds": seconds,
        "tokens_per_sec": builder.num_tokens / seconds,
    }
