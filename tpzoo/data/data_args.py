"""The data flags of ``pretrain.py`` and ``python -m tpzoo.data`` (Megatron-LM's names and meanings)
and what a run reads from them:

    --data-path PREFIX            one indexed dataset, split into train/valid/test by --split
    --data-path W1 P1 W2 P2 ...   Megatron-LM's blend: each prefix split, samples drawn by weight
                                  (``tpzoo.data.blended``)
    --train-data-path PREFIX      one prefix per split instead of --data-path + --split
    --valid-data-path PREFIX      (each split reads every document of its prefix)
    --test-data-path PREFIX
    --mock-data                   random tokens of the tokenizer's vocabulary (``tpzoo.data.mock``)
    --num-workers N               the next training batches read ahead by N processes (``tpzoo.data.loader``)
    --dataset FILES               raw files tokenized once into --data-cache-path
    tokenizer flags               ``tpzoo.data.tokenizer_types`` (--tokenizer-type, --vocab-file ...)

    tokenizer, prefix, sources = run_data(DataConfig.of(vars(args)), "gpt")   # the flags' values, typed
    build_datasets("gpt", tokenizer, prefix, ..., args.split, sources)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

from tpzoo.data.build import DEFAULT_CACHE, DataSources, data_kind, resolve_data
from tpzoo.data.sources import DATASET_PARTS, DatasetSource
from tpzoo.data.tokenizer import Tokenizer
from tpzoo.data.tokenizer_types import TOKENIZER_FLAGS, TokenizerFlags, add_tokenizer_args, tokenizer_of, tokenizer_type
from tpzoo.flag_types import non_negative_int

SPLIT_PATHS = ("train_data_path", "valid_data_path", "test_data_path")
# flags naming where the data is: at most one source
SOURCES = ("data_path", "dataset", "mock_data", "train_data_path")


class _Prefix(argparse.Action):
    """Megatron-LM's path list: ``PREFIX`` or ``WEIGHT PREFIX`` (one dataset: the prefix as given);
    with ``blend``, also ``W1 P1 W2 P2 ...`` (a list of those strings, the prefixes absolute)."""

    def __init__(self, *args: Any, blend: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.blend = blend

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Sequence[str],
                 option_string: str | None = None) -> None:
        if len(values) == 2 and _is_number(values[0]):
            values = values[1:]
        if len(values) == 1:
            setattr(namespace, self.dest, values[0])
            return
        pairs = len(values) % 2 == 0 and all(_is_number(w) and float(w) > 0 for w in values[::2])
        if not self.blend or not pairs:
            parser.error(f"{option_string} {' '.join(values)}: pass "
                         + ("PREFIX or WEIGHT PREFIX pairs with weights > 0" if self.blend else
                            "one PREFIX (a blend of weighted prefixes is --data-path's)"))
        setattr(namespace, self.dest, [v if k % 2 == 0 else os.path.abspath(v) for k, v in enumerate(values)])


def blend_of(data_path: list[str]) -> tuple[tuple[float, str], ...]:
    """The (weight, prefix) pairs of a blended ``--data-path`` (``_Prefix``'s list)."""
    return tuple((float(w), p) for w, p in zip(data_path[::2], data_path[1::2]))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def add_dataset_source_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the flags that pick what a ``--dataset`` folder or name holds: ``--dataset-config``,
    ``--dataset-split``, ``--json-key``."""
    parser.add_argument("--dataset-config", metavar="NAME",
                        help="the configuration of a --dataset name (datasets' load_dataset(name, NAME))")
    parser.add_argument("--dataset-split", metavar="SPLIT",
                        help="the split of a --dataset name or save_to_disk DatasetDict folder (default: train)")
    parser.add_argument("--json-key", default="text", metavar="KEY",
                        help="the text field of --dataset rows or columns (default: %(default)s)")


def add_cache_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add ``--data-cache-path DIR`` (Megatron-LM's name) to ``parser``."""
    parser.add_argument(
        "--data-cache-path",
        metavar="DIR",
        help="where --dataset files are tokenized and the demo corpus is built, once "
        f"(default: {DEFAULT_CACHE})",
    )


def add_data_args(parser: argparse.ArgumentParser, loader: bool = True) -> argparse.ArgumentParser:
    """Add the data and tokenizer flags (module docstring, ``--split``, ``--data-cache-path``) to
    ``parser``; ``loader``: also ``--num-workers`` (a training script's)."""
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", metavar="PREFIX", nargs="+", action=_Prefix, blend=True,
                       help="indexed dataset PREFIX (PREFIX.bin + PREFIX.idx), split by --split; or Megatron-LM's "
                       "blend W1 PREFIX1 W2 PREFIX2 ... (each prefix split, samples drawn by weight)")
    for split in ("train", "valid", "test"):
        group.add_argument(f"--{split}-data-path", metavar="PREFIX", nargs="+", action=_Prefix,
                           help=f"the {split} split's indexed dataset (instead of --data-path and --split)")
    group.add_argument("--mock-data", action="store_true",
                       help="random tokens of the tokenizer's vocabulary, fixed by --seed (needs tokenizer flags)")
    group.add_argument(
        "--dataset",
        metavar="SPEC",
        nargs="+",
        help="json/jsonl/txt/parquet/csv files, globs or folders; a folder saved by datasets' save_to_disk; or a "
        "dataset name in datasets' local cache (docs/data.md); tokenized once into --data-cache-path",
    )
    add_dataset_source_args(group)
    add_tokenizer_args(group)
    if loader:
        group.add_argument("--num-workers", type=non_negative_int, default=0, metavar="N",
                           help="DataLoader worker processes reading the next training batches ahead (tpzoo's 0: "
                           "read in the training process; Megatron-LM's 2)")
    group.add_argument(
        "--split", default="98,1,1", help="train,valid,test weights over documents (default: %(default)s)"
    )
    add_cache_arg(group)
    return parser


@dataclass(frozen=True)
class DataConfig:
    """The data flags' values (``add_data_args``; None: not given), what ``run_data`` reads. ``seed``: the mock
    data's (``--seed``)."""

    data_path: str | list[str] | None = None          # a prefix, or a blend's [W1, P1, W2, P2, ...]
    train_data_path: str | None = None
    valid_data_path: str | None = None
    test_data_path: str | None = None
    mock_data: bool = False
    dataset: list[str] | None = None
    dataset_config: str | None = None
    dataset_split: str | None = None
    json_key: str = "text"
    data_cache_path: str | None = None
    split: str = "98,1,1"                            # train,valid,test weights over documents (one prefix)
    num_workers: int = 0                             # DataLoader processes reading the train batches ahead
    seed: int = 0
    tokenizer: TokenizerFlags = TokenizerFlags()

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> DataConfig:
        """Its fields' values among ``values`` (a command's flags by destination); None or absent: the default."""
        own = {f.name: values[f.name] for f in fields(cls) if f.name != "tokenizer" and values.get(f.name) is not None}
        return cls(**own, tokenizer=TokenizerFlags.of(values))

    def source(self) -> DatasetSource | None:
        """The ``DatasetSource`` of ``--dataset`` (None without it; ValueError for its flags without it)."""
        if not self.dataset:
            given = [f for f in ("dataset_config", "dataset_split") if getattr(self, f) is not None]
            if given:
                raise ValueError(f"--{given[0].replace('_', '-')} goes with --dataset (a name or save_to_disk folder)")
            return None
        return DatasetSource(tuple(map(str, self.dataset)), self.dataset_config, self.dataset_split, self.json_key)


def check_data_flags(data: DataConfig) -> None:
    """What the data flags alone can be checked for (no file is read): one data source, the
    tokenizer flags complete (``tokenizer_type``). ValueError naming the flags."""
    given = [s for s in SOURCES if getattr(data, s)]
    if len(given) > 1:
        names = " and ".join("--" + s.replace("_", "-") for s in given)
        raise ValueError(f"pass one data source, not {names}")
    splits = [s for s in SPLIT_PATHS if getattr(data, s)]
    if splits and "train_data_path" not in splits:
        raise ValueError(f"--{splits[0].replace('_', '-')} needs --train-data-path beside it")
    if tokenizer_type(data.tokenizer) is None and data.mock_data and not data.tokenizer.tokenizer_model:
        raise ValueError("--mock-data draws tokens from a tokenizer's vocabulary: pass its flags, e.g. "
                         "--tokenizer-type NullTokenizer --vocab-size 1024, or --vocab-file + --merge-file")


def run_data(data: DataConfig, model: str, tokenizer: Tokenizer | None = None
             ) -> tuple[Tokenizer, str, DataSources | None]:
    """(tokenizer, prefix, sources) a run reads: ``prefix`` is the training data (what a checkpoint
    records; a blend's first prefix); ``sources`` (for ``build_datasets``) the blend of ``--data-path
    W1 P1 ...`` or the prefixes of ``--train-data-path`` ..., else None (``prefix`` split by
    ``--split``). ``tokenizer``: the flags' (``tokenizer_of``), read here when not given."""
    check_data_flags(data)
    tokenizer = tokenizer or tokenizer_of(data.tokenizer)
    cache = data.data_cache_path
    if data.mock_data:
        from tpzoo.data.mock import mock_prefix

        assert tokenizer is not None  # check_data_flags
        return tokenizer, mock_prefix(data_kind(model), tokenizer, data.seed, cache), None
    if isinstance(data.data_path, list):  # a blend: every prefix read by the first one's tokenizer
        blend = blend_of(data.data_path)
        tok, first = resolve_data(model, blend[0][1], None, tokenizer, cache)
        for _, prefix in blend[1:]:
            resolve_data(model, prefix, None, tok)
        return tok, first, DataSources(blend=blend)
    if not data.train_data_path:
        tok, prefix = resolve_data(model, data.data_path, data.source(), tokenizer, cache)
        return tok, prefix, None
    tok, train = resolve_data(model, data.train_data_path, None, tokenizer, cache)
    others = [resolve_data(model, getattr(data, s), None, tok)[1] if getattr(data, s) else None
              for s in SPLIT_PATHS[1:]]
    return tok, train, DataSources(per_split=(train, *others))


def _given_together() -> dict[str, set[str]]:
    """A resume's flags (``tpzoo.training.resolve.GIVEN_TOGETHER``): a data source given keeps every other
    source and the tokenizer flags from being restored (it brings its own tokenizer); a tokenizer
    flag given keeps the other tokenizer flags."""
    sources = {"data_path", "dataset", "mock_data", *SPLIT_PATHS}
    out = {s: (sources - {s}) | set(TOKENIZER_FLAGS) | set(DATASET_PARTS) for s in sources}
    out.update({t: set(TOKENIZER_FLAGS) - {t} for t in TOKENIZER_FLAGS})
    return out


DATA_GIVEN_TOGETHER = _given_together()
# flags that change what a run trains on, and flags naming files (made absolute in a checkpoint)
DATA_MEANING_FLAGS = ("data_path", "dataset", *DATASET_PARTS, "mock_data", *SPLIT_PATHS, *TOKENIZER_FLAGS, "split")
DATA_PATH_FLAGS = ("data_path", *SPLIT_PATHS, "tokenizer_model", "vocab_file", "merge_file", "data_cache_path")
