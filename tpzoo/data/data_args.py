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
    --mask-prob P                 masked-LM samples: the share of tokens picked for prediction (default 0.15)
    --reset-position-ids          causal-LM samples' packed documents (``tpzoo.data.documents``): positions restart,
    --reset-attention-mask        no token attends to another document,
    --eod-mask-loss               no loss where the input is the end-of-document token
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
from tpzoo.data.tokenizer_types import TOKENIZER_FLAGS, TokenizerFlags, tokenizer_of, tokenizer_type
from tpzoo.fields import add_section, at_least, boolean, check_fields, option, optional, parses, string, toggle
from tpzoo.flag_types import open_probability
from tpzoo.models.families import FAMILIES

SPLIT_PATHS = ("train_data_path", "valid_data_path", "test_data_path")
DOCUMENT_FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
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


def _prefixes(v: Any) -> str | None:
    ok = isinstance(v, str) or isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)
    return None if ok else f"must be a prefix or a blend's [W1, P1, W2, P2, ...], got {v!r}"


@parses(open_probability)
def _open_fraction(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1
    return None if ok else f"must lie in (0, 1), got {v!r}"


def _files(v: Any) -> str | None:
    ok = isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v)
    return None if ok else f"must be a list of files, globs, folders or a dataset name, got {v!r}"


_SOURCES = ("data_path", "dataset", "mock_data", *SPLIT_PATHS)


def _source(default: Any, check: Any, doc: str, flag: str, metavar: str | None = None, **role: Any) -> Any:
    """A flag naming where the data is: given on a resume, the checkpoint's other sources, dataset parts and
    tokenizer stay behind (another source brings its own tokenizer)."""
    return option(default, check, doc, flag, metavar, meaning=True, together=(*_SOURCES, *DATASET_PARTS,
                                                                               *TOKENIZER_FLAGS), **role)


def _split_path(split: str) -> Any:
    return _source(None, optional(string), f"the {split} split's indexed dataset (instead of --data-path and --split)",
                   f"--{split}-data-path", "PREFIX", path=True, nargs="+", action=_Prefix)


@dataclass(frozen=True)
class DataConfig:
    """The data and tokenizer flags (Megatron-LM's names; module docstring), what ``run_data`` reads; None: not
    given. ``seed``: the mock data's (``--seed``)."""

    data_path: str | list[str] | None = _source(
        None, optional(_prefixes), "indexed dataset PREFIX (PREFIX.bin + PREFIX.idx), split by --split; or "
        "Megatron-LM's blend W1 PREFIX1 W2 PREFIX2 ... (each prefix split, samples drawn by weight)", "--data-path",
        "PREFIX", path=True, nargs="+", action=_Prefix, action_options=dict(blend=True))
    train_data_path: str | None = _split_path("train")
    valid_data_path: str | None = _split_path("valid")
    test_data_path: str | None = _split_path("test")
    mock_data: bool = _source(False, boolean, "random tokens of the tokenizer's vocabulary, fixed by --seed (needs "
                              "tokenizer flags)", "--mock-data")
    dataset: list[str] | None = _source(None, optional(_files), "json/jsonl/txt/parquet/csv files, globs or folders; a "
                                        "folder saved by datasets' save_to_disk; or a dataset name in datasets' local "
                                        "cache (docs/data.md); tokenized once into --data-cache-path", "--dataset",
                                        "SPEC", nargs="+")
    dataset_config: str | None = option(None, optional(string), "the configuration of a --dataset name (datasets' "
                                        "load_dataset(name, NAME))", "--dataset-config", "NAME", meaning=True)
    dataset_split: str | None = option(None, optional(string), "the split of a --dataset name or save_to_disk "
                                       "DatasetDict folder (default: train)", "--dataset-split", "SPLIT", meaning=True)
    json_key: str = option("text", string, "the text field of --dataset rows or columns", "--json-key", "KEY",
                           meaning=True)
    tokenizer: TokenizerFlags = TokenizerFlags()
    num_workers: int = option(0, at_least(0), "DataLoader worker processes reading the next training batches ahead "
                              "(tpzoo's 0: read in the training process; Megatron-LM's 2)", "--num-workers", "N",
                              launch=True)
    split: str = option("98,1,1", string, "train,valid,test weights over documents", "--split", meaning=True)
    mask_prob: float | None = option(None, optional(_open_fraction), "the share of a masked-LM sample's tokens picked "
                                     "for prediction, in (0, 1) (default: 0.15, Megatron-LM's; masked-LM families "
                                     "only)", "--mask-prob", "P", meaning=True)
    reset_position_ids: bool = toggle("positions restart at each document of a sample (causal LMs; "
                                      "docs/parallelism.md)", "--reset-position-ids", meaning=True)
    reset_attention_mask: bool = toggle("no token attends to another document of its sample (causal LMs)",
                                        "--reset-attention-mask", meaning=True)
    eod_mask_loss: bool = toggle("no loss where the input is the end-of-document token (causal LMs)", "--eod-mask-loss",
                                 meaning=True)
    data_cache_path: str | None = option(None, optional(string), f"where --dataset files are tokenized and the demo "
                                         f"corpus is built, once (default: {DEFAULT_CACHE})", "--data-cache-path",
                                         "DIR", path=True)
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self)

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

    def document_flags(self) -> list[str]:
        """The packed-document flags given (``tpzoo.data.documents``)."""
        return [f"--{name.replace('_', '-')}" for name in DOCUMENT_FLAGS if getattr(self, name)]

    def document_marks(self, eod: int | None) -> Any:
        """The causal-LM samples' ``DocumentMarks`` of the document flags (None without them); ValueError when the
        tokenizer has no end-of-document id (``eod``) to find the documents by."""
        if not self.document_flags():
            return None
        if eod is None:
            raise ValueError(f"{' '.join(self.document_flags())} find the documents of a sample by the tokenizer's "
                             f"end-of-document token, and this tokenizer has none; use one with an eod token")
        from tpzoo.data.documents import DocumentMarks

        return DocumentMarks(eod, **{name: getattr(self, name) for name in DOCUMENT_FLAGS})

    def masked_lm_options(self) -> dict[str, Any]:
        """The ``BertDataset`` options (``build_datasets``' bert_options) of the flags given: ``--mask-prob``."""
        return {} if self.mask_prob is None else {"masked_lm_prob": self.mask_prob}


def add_data_args(parser: argparse.ArgumentParser, loader: bool = True, masking: bool = True
                  ) -> argparse.ArgumentParser:
    """The data and tokenizer flags (``DataConfig``) on ``parser``; ``loader``: also ``--num-workers`` (a training
    script's, with the packed-document flags); ``masking``: also ``--mask-prob`` (a command that makes masked-LM
    samples)."""
    skip = () if loader else ("num_workers", *DOCUMENT_FLAGS)
    add_section(parser, DataConfig, "data", skip if masking else (*skip, "mask_prob"))
    return parser


def add_cache_arg(parser: argparse.ArgumentParser) -> None:
    """``--data-cache-path DIR`` (Megatron-LM's name) alone on ``parser``."""
    others = [f.name for cls in (DataConfig, TokenizerFlags) for f in fields(cls) if f.name != "data_cache_path"]
    add_section(parser, DataConfig, "data", others, group=parser)


def check_data_flags(data: DataConfig, model: str | None = None) -> None:
    """What the data flags alone can be checked for (no file is read): one data source, the
    tokenizer flags complete (``tokenizer_type``), and with ``model`` (a family or data kind) ``--mask-prob`` for
    masked-LM data only. ValueError naming the flags."""
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
    if model is not None and data.document_flags() and data_kind(model) != "causal-lm":
        raise ValueError(f"{' '.join(data.document_flags())}: --model {model} reads {data_kind(model)} data, whose "
                         f"samples are single documents; drop them (they mark the documents packed in causal-LM "
                         f"samples)")
    if model is not None and data.mask_prob is not None and data_kind(model) != "masked-lm":
        masked = ", ".join(name for name, f in FAMILIES.items() if f.data == "masked-lm")
        raise ValueError(f"--mask-prob {data.mask_prob}: --model {model} reads {data_kind(model)} data, which masks "
                         f"no tokens; drop it (it sets the masked-LM families' masking: {masked})")


def run_data(data: DataConfig, model: str, tokenizer: Tokenizer | None = None
             ) -> tuple[Tokenizer, str, DataSources | None]:
    """(tokenizer, prefix, sources) a run reads: ``prefix`` is the training data (what a checkpoint
    records; a blend's first prefix); ``sources`` (for ``build_datasets``) the blend of ``--data-path
    W1 P1 ...`` or the prefixes of ``--train-data-path`` ..., else None (``prefix`` split by
    ``--split``). ``tokenizer``: the flags' (``tokenizer_of``), read here when not given."""
    check_data_flags(data, model)
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
