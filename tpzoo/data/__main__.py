"""``python -m tpzoo.data``: train a tokenizer, preprocess text into an indexed dataset, look at it.

    python -m tpzoo.data train-tokenizer --input corpus.jsonl --model-prefix tok --vocab-size 512
    python -m tpzoo.data preprocess --input corpus.jsonl --output-prefix gpt --tokenizer-model tok.model --append-eod
    python -m tpzoo.data preprocess --input corpus.jsonl --output-prefix my-gpt2 --vocab-file gpt2-vocab.json \
        --merge-file gpt2-merges.txt --tokenizer-type GPT2BPETokenizer --append-eod --workers 2
                                                        # Megatron-LM's flags: writes my-gpt2_text_document.bin/.idx
    python -m tpzoo.data inspect --data-path gpt
    python -m tpzoo.data samples --model gpt --data-path gpt --seq-length 32 --indices 0 1
    python -m tpzoo.data demo
    python -m tpzoo.data stdlib --export stdlib_files --per-class 50

Misuse exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from tpzoo.data.build import data_kind
from tpzoo.data.data_args import add_cache_arg, add_data_args
from tpzoo.data.tokenizer_types import add_tokenizer_args
from tpzoo.models.families import FAMILIES
from tpzoo.models.family_flag import add_model_flag
from tpzoo.flag_types import non_negative_int, positive_int, seed
from tpzoo.training.args import check_output_folder, command_parser


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "python -m tpzoo.data", "Train a tokenizer; preprocess text into an indexed dataset; look at it."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train-tokenizer", help="train a sentencepiece model (ids 0-5: [PAD] <unk> <eod> [CLS] [SEP] [MASK])"
    )
    p.add_argument("--input", nargs="+", required=True, help="json/jsonl/txt/parquet/csv/tsv files, globs or folders")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=positive_int, required=True)
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument("--json-key", default="text", help="the text field of json/parquet/csv rows (default: %(default)s)")
    p.add_argument("--max-sentences", type=positive_int, default=2_000_000, help="train on at most this many lines")

    p = sub.add_parser("preprocess", help="tokenize text into PREFIX.bin + PREFIX.idx (Megatron-LM's flags: "
                       "PREFIX_{key}_document.bin/.idx)")
    p.add_argument("--input", nargs="+", required=True, help="json/jsonl/txt/parquet/csv/tsv files, globs or folders")
    p.add_argument("--output-prefix", required=True)
    add_tokenizer_args(p)
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--json-key", help="the text field of json/parquet/csv rows (default: text)")
    keys.add_argument("--json-keys", nargs="+", metavar="KEY", help="Megatron-LM's: one dataset per key, "
                      "PREFIX_{key}_document (default: text)")
    p.add_argument("--workers", type=positive_int, default=1, help="tokenizing processes")
    p.add_argument("--partitions", type=positive_int, default=1, help="Megatron-LM's input partitions: 1 only "
                   "(--workers spreads one input over processes, in order)")
    p.add_argument("--append-eod", action="store_true", help="end every document with <eod> (causal LMs: GPT, Llama)")
    p.add_argument("--split-sentences", action="store_true", help="store sentences as sequences (masked LMs: BERT)")
    p.add_argument("--keep-newlines", action="store_true", help="with --split-sentences: keep the line breaks")
    p.add_argument("--log-interval", type=positive_int, help="a progress line every this many documents")

    p = sub.add_parser("inspect", help="print an indexed dataset's sizes and its first documents")
    add_data_args(p, loader=False, masking=False)
    p.add_argument("--seed", type=seed, default=1234, help="--mock-data's (default: %(default)s)")
    p.add_argument("--documents", type=non_negative_int, default=1, help="how many documents to decode")

    p = sub.add_parser("samples", help="print training samples as a trainer would see them")
    add_data_args(p, loader=False)
    add_model_flag(p, metavar="FAMILY", default="gpt", help=f"the family ({', '.join(FAMILIES)}, or module:NAME of "
                   f"your own); its data kind decides the samples (default: %(default)s)")
    p.add_argument("--seq-length", type=positive_int, default=64)
    p.add_argument("--seed", type=seed, default=1234)
    p.add_argument("--indices", type=non_negative_int, nargs="+", default=[0])
    p.add_argument("--whole-word-masking", action="store_true")
    p.add_argument("--binary-head", choices=("sop", "nsp", "none"), default="sop")

    p = sub.add_parser("demo", help="build (once) and print the demo tokenizer, datasets and task files")
    p.add_argument("--export", metavar="DIR",
                   help="also copy the tokenizer (tokenizer.model), the corpus (corpus.jsonl), the sentiment task, "
                   "text and instruction files (sentiment_*, text_*, instructions_*.jsonl) into DIR")
    add_cache_arg(p)

    p = sub.add_parser("stdlib", help="write real text: the standard library's docstrings, labelled by family "
                       "(tpzoo.data.stdlib_docs)")
    p.add_argument("--export", metavar="DIR", required=True,
                   help="writes corpus.jsonl (pretraining text), train.jsonl and valid.jsonl (text, label) into DIR")
    p.add_argument("--per-class", type=positive_int, default=50,
                   help="labelled training docstrings per family (default: %(default)s)")
    p.add_argument("--seed", type=seed, default=0, help="which docstrings are labelled (default: %(default)s)")
    return parser


def _inspect(args: argparse.Namespace) -> None:
    from tpzoo.data.data_args import DataConfig, run_data
    from tpzoo.data.indexed import IndexedDataset

    tok, prefix, _ = run_data(DataConfig.of(vars(args)), "causal-lm")
    data = IndexedDataset(prefix)
    print(
        json.dumps(
            {
                "prefix": prefix,
                "documents": data.num_documents,
                "sequences": data.num_sequences,
                "tokens": data.num_tokens,
                "dtype": str(data.dtype),
                "tokenizer": tok.path,
            }
        )
    )
    for d in range(min(args.documents, data.num_documents)):
        first, end = data.document_indices[d], data.document_indices[d + 1]
        print(json.dumps({"document": d, "sentences": [tok.decode(data.sequence(k)) for k in range(first, end)]}))


def _samples(args: argparse.Namespace) -> None:
    from tpzoo.data.build import build_datasets
    from tpzoo.data.data_args import DataConfig, run_data

    data = DataConfig.of(vars(args))
    tok, prefix, sources = run_data(data, args.model)
    causal = data_kind(args.model) == "causal-lm"
    options = (
        {}
        if causal
        else {
            "whole_word_masking": args.whole_word_masking,
            "binary_head": None if args.binary_head == "none" else args.binary_head,
            **data.masked_lm_options(),
        }
    )
    train, *_ = build_datasets(
        args.model, tok, prefix, args.seq_length, args.seed, (max(args.indices) + 1, 0, 0), args.split,
        sources, **options
    )
    pieces = tok.pieces()
    for i in args.indices:
        sample = train[i]
        if causal:
            print(
                json.dumps(
                    {"index": i, "input": tok.decode(sample["input_ids"]), "labels": tok.decode(sample["labels"])}
                )
            )
        else:
            n = int(sample["attention_mask"].sum())
            masked = [pieces[t] for t in sample["labels"][:n].tolist() if t >= 0]
            print(
                json.dumps(
                    {
                        "index": i,
                        "tokens": " ".join(pieces[t] for t in sample["input_ids"][:n].tolist()),
                        "masked": masked,
                        **({"next_sentence_label": int(sample["next_sentence_label"])}
                           if "next_sentence_label" in sample else {}),
                    }
                )
            )


def _demo(export: str | None, cache_path: str | None) -> None:
    import shutil

    from tpzoo.data.demo import PREFIXES, demo_data, demo_dir, demo_files, demo_task, unigram_entropy
    from tpzoo.data.tokenizer import load_tokenizer

    tok_path, causal = demo_data("causal-lm", cache_path)
    if export:
        os.makedirs(export, exist_ok=True)
        files = [path for kind in ("sentiment", "text", "instructions") for path in demo_files(kind, cache_path)]
        for path in [tok_path, demo_dir(cache_path) / "corpus.jsonl", *files]:
            shutil.copy(path, export)
    vocab = load_tokenizer(tok_path).vocab_size
    print(
        json.dumps(
            {
                "tokenizer": tok_path,
                **{kind: demo_data(kind, cache_path)[1] for kind in PREFIXES},
                "task": demo_task(cache_path),
                "unigram_entropy_nats": round(unigram_entropy(causal, vocab), 4),
            }
        )
    )


def megatron_names(args: argparse.Namespace) -> bool:
    """Whether ``preprocess`` names its outputs as Megatron-LM does (``PREFIX_{key}_document``): with
    any of Megatron-LM's own flags (``--json-keys``, ``--tokenizer-type``, ``--vocab-file``); tpzoo's
    ``PREFIX.bin`` with ``--tokenizer-model`` and ``--json-key`` alone."""
    return any(getattr(args, d) is not None for d in ("json_keys", "tokenizer_type", "vocab_file"))


def _preprocess(args: argparse.Namespace) -> None:
    """One dataset per json key: Megatron-LM's names or tpzoo's (``megatron_names``); a JSON line each."""
    from tpzoo.data.preprocess import megatron_prefix, preprocess
    from tpzoo.data.tokenizer_types import TokenizerFlags, tokenizer_of

    if args.partitions != 1:
        raise ValueError(f"--partitions {args.partitions}: tpzoo reads its input in one pass, spread over --workers "
                         f"processes in order; pass --workers {args.workers * args.partitions} without --partitions")
    tokenizer = tokenizer_of(TokenizerFlags.of(vars(args)))
    if tokenizer is None:
        raise ValueError("preprocess needs a tokenizer: --tokenizer-model FILE, --vocab-file + --merge-file (GPT-2), "
                         "--vocab-file (BERT) or --tokenizer-type")
    keys = args.json_keys or [args.json_key or "text"]
    for key in keys:
        prefix = (megatron_prefix(args.output_prefix, key, args.split_sentences) if megatron_names(args)
                  else args.output_prefix)
        stats = preprocess(args.input, prefix, tokenizer, key, args.workers, args.append_eod, args.split_sentences,
                           keep_newlines=args.keep_newlines, log_interval=args.log_interval)
        print(json.dumps({"prefix": prefix, **{k: round(v, 3) for k, v in stats.items()}}))


# command -> the flag naming the files it writes, and its destination
PREFIX_FLAGS = {
    "train-tokenizer": ("--model-prefix", "model_prefix"),
    "preprocess": ("--output-prefix", "output_prefix"),
}


def _check_outputs(args: argparse.Namespace) -> None:
    """What a command writes can be made: ``--export`` a folder, a prefix a file name in a folder."""
    if args.command in ("demo", "stdlib"):
        check_output_folder("--export", args.export)
    elif args.command in PREFIX_FLAGS:
        flag, dest = PREFIX_FLAGS[args.command]
        prefix = getattr(args, dest)
        if prefix.endswith(os.sep) or os.path.isdir(prefix):
            raise ValueError(f"{flag} {prefix} is a folder; give a file name prefix in it, like "
                             f"{os.path.join(prefix, 'data')}")
        check_output_folder(flag, os.path.dirname(os.path.abspath(prefix)))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_outputs(args)
        if args.command == "train-tokenizer":
            from tpzoo.data.tokenizer import train_tokenizer

            print(
                train_tokenizer(
                    args.input, args.model_prefix, args.vocab_size, args.model_type, args.json_key, args.max_sentences
                )
            )
        elif args.command == "preprocess":
            _preprocess(args)
        elif args.command == "inspect":
            _inspect(args)
        elif args.command == "samples":
            _samples(args)
        elif args.command == "stdlib":
            from tpzoo.data.stdlib_docs import export

            print(json.dumps({"export": args.export, **export(args.export, args.per_class, args.seed)}))
        else:
            _demo(args.export, args.data_cache_path)
    except (OSError, ValueError, ImportError) as e:
        message = " ".join(str(e).split())
        print(f"python -m tpzoo.data {args.command}: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
