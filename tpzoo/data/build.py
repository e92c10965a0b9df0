"""What a trainer calls: pick the data (``--data-path`` / ``--dataset`` / the demo) and build the
train/valid/test datasets from ``--split``, ``--seq-length``, ``--seed`` and the samples needed.

    tok, prefix = resolve_data("gpt", data_path, dataset_source, tokenizer, data_cache_path)
    train, valid, test = build_datasets("gpt", tok, prefix, seq_length, seed,
                                        samples_needed(train_iters, G, eval_interval, eval_iters), split)
    batch_k = [train[i] for i in range(k * G, (k + 1) * G)]   # the same on any mesh

``tpzoo.data.data_args.run_data(DataConfig, ...)`` does the first line for every data flag (--mock-data,
--train-data-path ...).

``model`` is a family name (``--model``: "gpt", "llama", "bert" ...) or a data kind: what is read
follows the family's data kind (``tpzoo.models.families``): "causal-lm" reads documents ending in
end-of-document as ``GPTDataset`` windows, "masked-lm" sentence-split documents as ``BertDataset``
samples. Every family of a data kind reads the same tokenized ``--dataset`` cache (``cache_name``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tpzoo.data.cache import cache_dir, cached_build
from tpzoo.data.indexed import IndexedDataset, paths
from tpzoo.data.progress import is_main_process, say
from tpzoo.data.sources import DatasetSource, absolute_specs
from tpzoo.data.tokenizer import Tokenizer, load_tokenizer, recorded_tokenizer
from tpzoo.models.families import DATA_KINDS, FAMILIES, family

DEFAULT_CACHE = "$TPZOO_CACHE, else ~/.cache/tpzoo"


def data_kind(model: str) -> str:
    """The data kind ("causal-lm" or "masked-lm") of a registered family (``family`` takes its name or its
    module:NAME), or of a data kind itself."""
    if model in DATA_KINDS:
        return model
    try:
        return family(model).data
    except ValueError:
        raise ValueError(f"model must be one of {', '.join(FAMILIES)} (a registered family, or its module:NAME) or "
                         f"a data kind ({', '.join(DATA_KINDS)}), got {model!r}") from None


def cache_name(model: str) -> str:
    """What the tokenized ``--dataset`` cache of ``model``'s data kind is filed under: the first
    registered family of that kind ("gpt" for every causal LM), so that all its families share one
    tokenization and caches written before the family registry stay valid."""
    kind = data_kind(model)
    return next(name for name, f in FAMILIES.items() if f.data == kind)


def parse_split(split: str) -> list[float]:
    """``"98,1,1"`` (or ``98/1/1``; missing weights are 0) -> three fractions summing to 1."""
    try:
        weights = [float(w) for w in re.split(r"[,/]", str(split))]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"--split {split!r} must be up to three non-negative weights like 98,1,1")
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def split_documents(num_documents: int, split: str) -> list[np.ndarray]:
    """Three consecutive ranges of document ids (int64), sized by ``split``."""
    bounds = [0] + [int(round(c * num_documents)) for c in np.cumsum(parse_split(split))]
    return [np.arange(bounds[k], bounds[k + 1], dtype=np.int64) for k in range(3)]


def samples_needed(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> tuple[int, int, int]:
    """(train, valid, test) sample counts: every iteration's batch, every evaluation's batches, one test."""
    evals = (train_iters // eval_interval + 1) * eval_iters if eval_interval > 0 else 0
    return train_iters * global_batch_size, evals * global_batch_size, eval_iters * global_batch_size


def prepare_dataset(spec: Any, tokenizer: Tokenizer, model: str, cache_path: str | None = None) -> str:
    """Tokenize ``--dataset`` (a ``DatasetSource``, or file specs read with its defaults) once into
    ``cache_dir(cache_path)/datasets/``; returns the indexed-dataset prefix. The cache key covers what
    identifies the source (``DatasetSource.open``'s stamp), the tokenizer and the data kind
    (``cache_name``). Says on stderr where the data is, whether it is built now or found."""
    from tpzoo.data.preprocess import write_indexed

    source = spec if isinstance(spec, DatasetSource) else DatasetSource.of(spec)
    causal, filed_as = data_kind(model) == "causal-lm", cache_name(model)
    documents, stamp, what = source.open()
    key = hashlib.sha256(json.dumps([stamp, tokenizer.sha256, filed_as]).encode()).hexdigest()[:16]
    name = f"datasets/{filed_as}-{key}"
    final = cache_dir(cache_path) / name
    if final.is_dir():
        if is_main_process():
            say(f"tokenized dataset: {final / 'data'} (cached; delete {final} to rebuild)")
        return str(final / "data")
    title = (f"tokenizing {what} with {os.path.basename(tokenizer.path)} into {final / 'data'} "
             "(once; later runs reuse it)")
    metadata = {"json_key": source.key, "inputs": absolute_specs(source.specs)}

    def build(out: Path) -> None:
        write_indexed(documents(), str(out / "data"), tokenizer, append_eod=causal, split_sentences=not causal,
                      metadata=metadata, title=title)

    return str(cached_build(name, build, cache_path) / "data")


def resolve_data(
    model: str,
    data_path: str | None = None,
    dataset: Any = None,
    tokenizer_model: Tokenizer | str | None = None,
    cache_path: str | None = None,
) -> tuple[Tokenizer, str]:
    """The tokenizer and indexed-dataset prefix a run uses: ``data_path``; else ``dataset`` files
    tokenized into the cache (``cache_path``, see ``cache_dir``); else the bundled demo corpus
    (built there too; tokenized again when ``tokenizer_model`` is not the demo's). ``tokenizer_model``: a Tokenizer
    or a ``load_tokenizer`` path; without one the tokenizer recorded in the dataset is used. Raises ValueError if they
    do not match."""
    data_kind(model)  # a known family or kind
    if data_path and dataset:
        raise ValueError("pass either --data-path or --dataset, not both")
    tok = (load_tokenizer(tokenizer_model) if isinstance(tokenizer_model, (str, os.PathLike))
           else tokenizer_model)
    if not data_path and not dataset:
        from tpzoo.data.demo import DEMO_TOKENIZER, demo_data, demo_dir

        demo = load_tokenizer(DEMO_TOKENIZER)
        if tok is None or tok.sha256 == demo.sha256:
            tok, data_path = tok or demo, demo_data(model, cache_path)[1]
        else:  # another tokenizer (a converted model's): the demo corpus tokenized with it, into the cache
            dataset = str(demo_dir(cache_path) / "corpus.jsonl")
    if dataset:
        if tok is None:
            raise ValueError("--dataset needs --tokenizer-model (a sentencepiece .model file), --vocab-file + "
                             "--merge-file or --tokenizer-type to tokenize with")
        return tok, prepare_dataset(dataset, tok, model, cache_path)
    indexed = IndexedDataset(data_path)
    recorded = indexed.metadata.get("tokenizer")
    tok = tok or recorded_tokenizer(recorded)
    if tok is None and recorded:
        raise ValueError(f"dataset {data_path!r} was tokenized with {recorded.get('path', recorded['kind'])}, which "
                         "is not on this machine; pass the tokenizer flags (--tokenizer-model, --vocab-file ...)")
    if tok is None:
        raise ValueError(f"dataset {data_path!r} names no tokenizer (made by Megatron-LM?): pass its tokenizer "
                         "flags: --vocab-file vocab.json --merge-file merges.txt (GPT-2), --vocab-file vocab.txt "
                         "(BERT), --tokenizer-model, or --tokenizer-type NullTokenizer --vocab-size N")
    check_data_tokenizer(indexed, tok)
    return tok, str(data_path)


def check_data_tokenizer(indexed: IndexedDataset, tokenizer: Tokenizer) -> None:
    """ValueError unless ``tokenizer`` reads ``indexed``: the one it was made with (its metadata), and
    a vocabulary holding every id of it. A NullTokenizer (ids as they are) needs only the latter."""
    recorded = indexed.metadata.get("tokenizer")
    if tokenizer.kind != "NullTokenizer":
        indexed.check_tokenizer(tokenizer)
    if recorded:
        top = recorded["vocab_size"] - 1
    elif np.iinfo(indexed.dtype).max < tokenizer.vocab_size or not indexed.num_tokens:
        return  # every id the dtype holds is in the vocabulary
    else:
        bin_path = paths(indexed.prefix)[0]
        top = largest_id(bin_path, os.stat(bin_path).st_mtime_ns)
    if top >= tokenizer.vocab_size:
        raise ValueError(f"dataset {indexed.prefix!r} holds token ids up to {top} but the tokenizer {tokenizer.path} "
                         f"has a vocabulary of {tokenizer.vocab_size}; pass the tokenizer the data was made with")


@functools.lru_cache(maxsize=64)
def largest_id(bin_path: str, mtime_ns: int) -> int:
    """The largest token id of an indexed dataset's ``.bin`` (read once per process and file version: a
    Megatron-LM prefix carries no vocabulary size, so its ids are scanned, in 64 Mi-token slices)."""
    indexed = IndexedDataset(bin_path.removesuffix(".bin"))
    return int(max(indexed.tokens[i:i + (1 << 26)].max() for i in range(0, indexed.num_tokens, 1 << 26)))


@dataclass(frozen=True)
class DataSources:
    """Where a run's splits come from besides one prefix: ``blend``, (weight, prefix) pairs each cut
    by ``--split`` and blended (Megatron-LM's ``--data-path W1 P1 W2 P2``), or ``per_split`` prefixes
    (train, valid, test; None where not given) read whole (``--train-data-path`` ...)."""

    blend: tuple[tuple[float, str], ...] = ()
    per_split: tuple[str | None, str | None, str | None] | None = None


def build_datasets(
    model: str,
    tokenizer: Tokenizer,
    prefix: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    split: str = "98,1,1",
    sources: DataSources | None = None,
    marks: Any = None,
    **bert_options: Any,
) -> tuple[Any, Any, Any]:
    """(train, valid, test) map-style datasets over ``prefix`` with ``num_samples`` samples each
    (None where 0 are asked). Causal-LM samples are ``GPTDataset`` windows, masked-LM ones ``BertDataset``
    samples (``bert_options``: binary_head, masked_lm_prob, whole_word_masking, short_seq_prob).
    ``sources``: a blend (each prefix's ``split`` share, ``tpzoo.data.blended``) or one prefix per
    split, whole (ValueError if samples are asked of a split without one), instead of ``prefix``. ``marks``: the
    causal-LM samples' document marks (``tpzoo.data.documents.DocumentMarks``)."""
    from tpzoo.data.bert_dataset import BertDataset
    from tpzoo.data.blended import BlendedDataset, blend_sizes, normalized
    from tpzoo.data.gpt_dataset import GPTDataset

    causal = data_kind(model) == "causal-lm"
    if sources is not None and sources.per_split is not None:
        parts = []  # per split: [(weight, indexed, documents)]
        for name, p, n in zip(("--train-data-path", "--valid-data-path", "--test-data-path"), sources.per_split,
                              num_samples):
            if p is None and n:
                raise ValueError(f"{n} samples are asked of a split without data: pass {name}")
            indexed = _checked(p, tokenizer, causal, model) if p else None
            parts.append([(1.0, indexed, np.arange(indexed.num_documents if indexed else 0, dtype=np.int64))])
    else:
        blend = sources.blend if sources is not None and sources.blend else ((1.0, prefix),)
        weights = normalized([w for w, _ in blend])
        per_prefix = []
        for w, (_, p) in zip(weights, blend):
            indexed = _checked(p, tokenizer, causal, model)
            per_prefix.append([(w, indexed, docs) for docs in split_documents(indexed.num_documents, split)])
        parts = [list(split_parts) for split_parts in zip(*per_prefix)]

    def dataset(k: int, indexed: IndexedDataset, docs: np.ndarray, n: int) -> Any:
        if causal:
            return GPTDataset(indexed, docs, seq_length, n, seed, k, marks)
        return BertDataset(indexed, docs, tokenizer, seq_length, n, seed, k, **bert_options)

    out = []
    for k, split_parts in enumerate(parts):
        n = num_samples[k]
        if not n:
            out.append(None)
        elif len(split_parts) == 1:
            out.append(dataset(k, *split_parts[0][1:], n))
        else:
            weights = [w for w, _, _ in split_parts]
            subsets = [dataset(k, indexed, docs, size)
                       for (_, indexed, docs), size in zip(split_parts, blend_sizes(weights, n))]
            out.append(BlendedDataset(subsets, weights, n))
    return tuple(out)  # type: ignore[return-value]


def _checked(prefix: str, tokenizer: Tokenizer, causal: bool, model: str) -> IndexedDataset:
    """``IndexedDataset(prefix)`` read by ``tokenizer``, with documents that end for a causal LM."""
    indexed = IndexedDataset(prefix)
    check_data_tokenizer(indexed, tokenizer)
    if causal and indexed.metadata.get("append_eod") is False:
        raise ValueError(
            f"dataset {prefix!r} was preprocessed without --append-eod, so its documents would run "
            f"together; preprocess it again with --append-eod for a causal LM ({model})"
        )
    return indexed
