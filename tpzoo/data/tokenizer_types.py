"""Megatron-LM's ``--tokenizer-type`` names and their tokenizers (``Tokenizer`` interface):

    GPT2BPETokenizer            --vocab-file vocab.json --merge-file merges.txt   byte-level BPE, eod <|endoftext|>
    BertWordPieceLowerCase      --vocab-file vocab.txt    WordPiece, lower-cased, accents stripped
    BertWordPieceCase           --vocab-file vocab.txt    WordPiece, as written
    SentencePieceTokenizer, GPTSentencePieceTokenizer     --tokenizer-model x.model
    Llama2Tokenizer             --tokenizer-model x.model  (every document starts with the model's BOS)
    HuggingFaceTokenizer        --tokenizer-model DIR or tokenizer.json (local; no hub download)
    NullTokenizer               --vocab-size N: text is space-separated ids; vocabulary N, eod N - 1
                                (Megatron-LM's current NullTokenizer; --null-tokenizer-eod-id/-pad-id)

Without ``--tokenizer-type`` (Megatron-LM's examples give none): ``--vocab-file`` + ``--merge-file``
is GPT2BPETokenizer, ``--vocab-file`` alone BertWordPieceLowerCase, ``--tokenizer-model`` a file or
folder as ``load_tokenizer`` reads it. The vocabulary padding (``--make-vocab-size-divisible-by``)
belongs to the model config, not to the tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Iterable, Mapping

from tpzoo.data.tokenizer import (HFTokenizer, SentencePieceTokenizer, Tokenizer, byte_level_bpe, hf_tokenizers,
                                  load_tokenizer)
from tpzoo.fields import add_section, at_least, check_fields, integer, one_of, option, optional, string


class GPT2BPETokenizer(HFTokenizer):
    """GPT-2's byte-level BPE from a ``vocab.json`` and a ``merges.txt`` (any names, any folders)."""

    kind = "GPT2BPETokenizer"

    def __init__(self, path: str, merge_file: str) -> None:  # path: the vocab file
        self.path, self.merge_file = str(path), str(merge_file)
        self.files = [self.path, self.merge_file]
        self._wrap(byte_level_bpe(self.path, self.merge_file))

    def options(self) -> dict[str, Any]:
        return {**super().options(), "merge_file": os.path.abspath(self.merge_file)}


class BertWordPieceLowerCase(HFTokenizer):
    """BERT's WordPiece from a ``vocab.txt`` (one token a line, id = line number), lower-cased and
    accents stripped; [CLS] [SEP] [MASK] [PAD] [UNK] are looked up in it, eod is [SEP]."""

    kind = "BertWordPieceLowerCase"
    lower_case = True

    def __init__(self, path: str) -> None:
        hf = hf_tokenizers()
        self.path = str(path)
        self.files = [self.path]
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"WordPiece vocabulary {self.path!r} does not exist; pass a BERT vocab.txt")
        with open(self.path, encoding="utf-8") as f:
            vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
        missing = [t for t in ("[UNK]", "[CLS]", "[SEP]", "[MASK]", "[PAD]") if t not in vocab]
        if missing:
            raise ValueError(f"{self.path!r} ({len(vocab)} lines) lacks {' '.join(missing)}; pass a BERT vocab.txt")
        tok = hf.Tokenizer(hf.models.WordPiece(vocab, unk_token="[UNK]"))
        tok.normalizer = hf.normalizers.BertNormalizer(lowercase=self.lower_case, strip_accents=self.lower_case)
        tok.pre_tokenizer = hf.pre_tokenizers.BertPreTokenizer()
        tok.decoder = hf.decoders.WordPiece(prefix="##")
        tok.add_special_tokens(["[UNK]", "[CLS]", "[SEP]", "[MASK]", "[PAD]"])
        self._wrap(tok)


class BertWordPieceCase(BertWordPieceLowerCase):
    """BERT's WordPiece, case and accents kept (``bert-*-cased`` vocabularies)."""

    kind = "BertWordPieceCase"
    lower_case = False


class NullTokenizer(Tokenizer):
    """No vocabulary file: text is token ids separated by spaces (``"5 17 3"``), for data already
    tokenized and for ``--mock-data``. ``vocab_size`` N; eod N - 1 unless ``eod`` is given; no pad
    token unless ``pad`` >= 0 (Megatron-LM's ``--null-tokenizer-eod-id`` / ``--null-tokenizer-pad-id``)."""

    kind = "NullTokenizer"

    def __init__(self, vocab_size: int, eod: int | None = None, pad: int | None = None) -> None:
        if int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1 if eod is None else int(eod)
        self.pad = None if pad is None or pad < 0 else int(pad)
        for name in ("eod", "pad"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"NullTokenizer {name} id {value} lies outside its vocabulary of {self.vocab_size}")
        self.path, self.files = f"NullTokenizer(vocab_size={self.vocab_size})", []

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer reads space-separated token ids, not {text[:40]!r}") from None
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise ValueError(f"NullTokenizer text holds ids {min(ids)}..{max(ids)} outside its vocabulary of "
                             f"{self.vocab_size}; pass a larger --vocab-size")
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def pieces(self) -> list[str]:
        return [str(i) for i in range(self.vocab_size)]

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.options(), sort_keys=True).encode()).hexdigest()

    def options(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad}


MEGATRON_KINDS: dict[str, type[Tokenizer]] = {
    cls.kind: cls for cls in (GPT2BPETokenizer, BertWordPieceLowerCase, BertWordPieceCase, NullTokenizer)
}
# --tokenizer-type -> the flags it reads
TYPES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}
REFUSED_TYPES = {
    "TikTokenizer": "tpzoo has no tiktoken tokenizer; convert it to a Hugging Face tokenizer.json "
                    "(HuggingFaceTokenizer)",
    "MultimodalTokenizer": "tpzoo trains text models only",
    "NullMultimodalTokenizer": "tpzoo trains text models only",
    "SFTTokenizer": "tpzoo has no chat prompt formats (fine-tuning: finetune.py)",
}
NULL_OPTIONS = ("null_tokenizer_eod_id", "null_tokenizer_pad_id")  # NullTokenizer's only


class _TokenizerType(argparse.Action):
    """``--tokenizer-type NAME``: one of ``TYPES``; a ``REFUSED_TYPES`` name ends parsing with its reason."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any,
                 option_string: str | None = None) -> None:
        if value in REFUSED_TYPES:
            parser.error(f"--tokenizer-type {value} is a Megatron-LM tokenizer tpzoo does not support: "
                         f"{REFUSED_TYPES[value]}")
        if value not in TYPES:
            parser.error(f"--tokenizer-type {value} is unknown; pass one of {', '.join(TYPES)}")
        setattr(namespace, self.dest, value)


_NAMES = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size", *NULL_OPTIONS)


def _tokenizer(default: Any, check: Any, doc: str, flag: str, metavar: str, **role: Any) -> Any:
    """A tokenizer flag: what the run trains on; given on a resume, the checkpoint's other tokenizer flags stay."""
    return option(default, check, doc, flag, metavar, meaning=True, together=_NAMES, **role)


@dataclass(frozen=True)
class TokenizerFlags:
    """Megatron-LM's tokenizer flags, and ``--tokenizer-model`` (a file or folder alone: tpzoo's); None: not given.
    What ``tokenizer_of`` reads."""

    tokenizer_type: str | None = _tokenizer(None, optional(one_of(*TYPES)), f"Megatron-LM's tokenizer name: "
                                            f"{', '.join(TYPES)} (without it: the one the files given mean)",
                                            "--tokenizer-type", "NAME", action=_TokenizerType)
    vocab_file: str | None = _tokenizer(None, optional(string), "GPT-2 vocab.json (with --merge-file) or BERT "
                                        "vocab.txt", "--vocab-file", "FILE", path=True)
    merge_file: str | None = _tokenizer(None, optional(string), "GPT-2 merges.txt", "--merge-file", "FILE", path=True)
    tokenizer_model: str | None = _tokenizer(None, optional(string), "sentencepiece .model, or a Hugging Face "
                                             "tokenizer.json or folder (default: the one the data was made with)",
                                             "--tokenizer-model", "PATH", path=True)
    vocab_size: int | None = _tokenizer(None, optional(at_least(1)), "NullTokenizer's vocabulary (eod = N - 1)",
                                        "--vocab-size", "N")
    null_tokenizer_eod_id: int | None = _tokenizer(None, optional(integer), "NullTokenizer's eod (N - 1 when not "
                                                   "given)", "--null-tokenizer-eod-id", "ID")
    null_tokenizer_pad_id: int = _tokenizer(-1, integer, "NullTokenizer's pad (default: -1, none)",
                                            "--null-tokenizer-pad-id", "ID")

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> TokenizerFlags:
        """Its fields' values among ``values`` (a command's flags by destination); None or absent: the default."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if values.get(f.name) is not None})


TOKENIZER_FLAGS = tuple(f.name for f in fields(TokenizerFlags))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_tokenizer_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The tokenizer flags (``TokenizerFlags``) on ``parser``."""
    add_section(parser, TokenizerFlags, "tokenizer", group=parser)


def tokenizer_type(flags: TokenizerFlags) -> str | None:
    """``--tokenizer-type``, else the one the files given mean (see the module docstring); None for
    ``--tokenizer-model`` alone or no tokenizer flag. ValueError naming the flags missing or unused."""
    name = flags.tokenizer_type
    unset = {"null_tokenizer_pad_id": -1}
    given = [d for d in TOKENIZER_FLAGS[1:] if getattr(flags, d) not in (None, unset.get(d))]
    if name is None:
        if flags.vocab_file is not None:
            name = "GPT2BPETokenizer" if flags.merge_file is not None else "BertWordPieceLowerCase"
        elif flags.merge_file is not None:
            raise ValueError("--merge-file needs --vocab-file (GPT-2's vocab.json) beside it")
        elif null := [d for d in given if d in ("vocab_size", *NULL_OPTIONS)]:
            raise ValueError(f"{_flag(null[0])} is NullTokenizer's; add --tokenizer-type NullTokenizer")
        else:
            return None
    missing = [_flag(d) for d in TYPES[name] if getattr(flags, d) is None]
    unused = [_flag(d) for d in given if d not in TYPES[name] + (NULL_OPTIONS if name == "NullTokenizer" else ())]
    if missing or unused:
        needs = " and ".join(_flag(d) for d in TYPES[name])
        problem = f"lacks {' and '.join(missing)}" if missing else f"does not read {' and '.join(unused)}"
        raise ValueError(f"--tokenizer-type {name} {problem}: it takes {needs}")
    return name


def tokenizer_of(flags: TokenizerFlags) -> Tokenizer | None:
    """The tokenizer the flags name, or None (the data's own tokenizer, or the demo's)."""
    name = tokenizer_type(flags)
    if name is None:
        return load_tokenizer(flags.tokenizer_model) if flags.tokenizer_model else None
    if name in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return SentencePieceTokenizer(flags.tokenizer_model, bos=name == "Llama2Tokenizer")
    if name == "HuggingFaceTokenizer":
        if not os.path.exists(flags.tokenizer_model):
            raise FileNotFoundError(f"--tokenizer-model {flags.tokenizer_model} does not exist; HuggingFaceTokenizer "
                                    "takes a local folder or tokenizer.json (tpzoo downloads nothing)")
        return HFTokenizer(flags.tokenizer_model)
    if name == "GPT2BPETokenizer":
        return GPT2BPETokenizer(flags.vocab_file, flags.merge_file)
    if name == "NullTokenizer":
        return NullTokenizer(flags.vocab_size, flags.null_tokenizer_eod_id, flags.null_tokenizer_pad_id)
    return MEGATRON_KINDS[name](flags.vocab_file)
