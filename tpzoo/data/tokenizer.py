"""Tokenizers: train and load sentencepiece models; load Hugging Face tokenizers. Megatron-LM's
``--tokenizer-type`` kinds (GPT-2 BPE, BERT WordPiece, NullTokenizer) are in ``tokenizer_types``.

Every tokenizer exposes ``vocab_size``, ``encode(text) -> list[int]``, ``decode(ids) -> str``, the
special ids ``eod``, ``pad``, ``cls``, ``sep``, ``mask``, ``unk`` (None where the model lacks one),
``word_start`` (a bool array over the vocabulary, for whole-word masking) and ``reference()``, a
JSON-able dict (kind, its files and options, sha256, vocab_size) that a checkpoint and a dataset's
index store to name it: ``load_tokenizer(**reference)`` loads the same kind back.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from functools import cached_property
from typing import Any, Iterable

import numpy as np

from tpzoo.data.sources import iter_texts

# Pieces of every tokenizer trained here, in id order: pad, unk and eod, then BERT's control tokens.
SPECIAL_PIECES = {"pad": "[PAD]", "unk": "<unk>", "eod": "<eod>", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
# Names under which a Hugging Face vocabulary may hold each special token.
_HF_NAMES = {
    "eod": ("<|endoftext|>", "</s>", "<eod>", "[SEP]"),
    "pad": ("[PAD]", "<pad>"),
    "unk": ("[UNK]", "<unk>", "<|endoftext|>"),
    "cls": ("[CLS]", "<s>"),
    "sep": ("[SEP]", "</s>"),
    "mask": ("[MASK]", "<mask>"),
}


def sha256_of(paths: Iterable[str]) -> str:
    """Hex sha256 of the concatenated bytes of ``paths``."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


class Tokenizer:
    """Common surface of the tokenizers; subclasses set ``kind``, ``path``, ``files`` and the ids."""

    kind: str
    path: str
    files: list[str]
    vocab_size: int
    eod: int | None = None
    pad: int | None = None
    unk: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, on this process only."""
        return [self.encode(t) for t in texts]

    def pieces(self) -> list[str]:
        """The string of every id, in id order."""
        raise NotImplementedError

    @property
    def special_ids(self) -> list[int]:
        """Ids of the special tokens this tokenizer has (never masked or drawn as random tokens)."""
        ids = (self.eod, self.pad, self.unk, self.cls, self.sep, self.mask)
        return sorted({i for i in ids if i is not None})

    @cached_property
    def word_start(self) -> np.ndarray:
        """bool[vocab_size]: True where a token begins a word (``▁``/``Ġ`` prefix, or no ``##``)."""
        pieces = self.pieces()
        if any(p.startswith("##") for p in pieces):
            starts = [not p.startswith("##") for p in pieces]
        else:
            starts = [p[:1] in ("\u2581", "\u0120") for p in pieces]
        out = np.array(starts, dtype=bool)
        out[self.special_ids] = True
        return out

    @cached_property
    def sha256(self) -> str:
        return sha256_of(self.files)

    def options(self) -> dict[str, Any]:
        """The constructor's arguments (JSON-able, files absolute): ``type(self)(**options())`` is this tokenizer."""
        return {"path": os.path.abspath(self.path)}

    def reference(self) -> dict[str, Any]:
        """What a checkpoint records: ``load_tokenizer(**ref)`` loads it back and checks the hash."""
        return {"kind": self.kind, **self.options(), "sha256": self.sha256, "vocab_size": self.vocab_size}

    def __getstate__(self) -> dict[str, Any]:  # pickles as its options: worker processes load it again
        return self.options()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size})"


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``.model`` file (BPE or unigram). ``bos``: every ``encode`` starts with the
    model's beginning-of-sequence id (Megatron-LM's Llama2Tokenizer)."""

    kind = "sentencepiece"

    def __init__(self, path: str, bos: bool = False) -> None:
        import sentencepiece as spm

        self.path, self.bos = str(path), bos
        self.files = [self.path]
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.path)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{self.path!r} is not a sentencepiece model ({e}); pass a .model file") from None
        self.vocab_size = self.sp.get_piece_size()
        for name, piece in SPECIAL_PIECES.items():
            i = self.sp.piece_to_id(piece)
            setattr(self, name, i if self.sp.id_to_piece(i) == piece else None)
        if self.unk is None:
            self.unk = self.sp.unk_id()
        if self.eod is None and self.sp.eos_id() >= 0:  # a model not trained here (Llama's </s>)
            self.eod = self.sp.eos_id()
        if bos and self.sp.bos_id() < 0:
            raise ValueError(f"{self.path!r} has no beginning-of-sequence piece for Llama2Tokenizer; "
                             "use --tokenizer-type SentencePieceTokenizer")

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=1, add_bos=self.bos)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def pieces(self) -> list[str]:
        return [self.sp.id_to_piece(i) for i in range(self.vocab_size)]

    def options(self) -> dict[str, Any]:
        return {**super().options(), **({"bos": True} if self.bos else {})}


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer: ``tokenizer.json``, or GPT-2's ``vocab.json`` + ``merges.txt``
    (a file, or a folder holding them). Encodes without adding special tokens."""

    kind = "huggingface"

    def __init__(self, path: str) -> None:
        self.path = str(path)
        folder = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
        tok_json = self.path if os.path.isfile(self.path) else os.path.join(folder, "tokenizer.json")
        if os.path.isfile(tok_json):
            self.files = [tok_json]
            self._wrap(hf_tokenizers().Tokenizer.from_file(tok_json))
        else:
            self.files = [os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")]
            self._wrap(byte_level_bpe(*self.files))

    def _wrap(self, tok: Any) -> None:
        """Use the ``tokenizers.Tokenizer`` ``tok``; the special ids are looked up by name (``_HF_NAMES``)."""
        self.tok = tok
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        for name, candidates in _HF_NAMES.items():
            setattr(self, name, next((vocab[c] for c in candidates if c in vocab), None))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def pieces(self) -> list[str]:
        by_id = {i: t for t, i in self.tok.get_vocab(with_added_tokens=True).items()}
        return [by_id.get(i, "") for i in range(self.vocab_size)]


def hf_tokenizers() -> Any:
    """The ``tokenizers`` library, or ImportError naming how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise ImportError("a Hugging Face, GPT-2 BPE or WordPiece tokenizer needs `pip install tokenizers`") from None
    return tokenizers


def byte_level_bpe(vocab_file: str, merge_file: str) -> Any:
    """GPT-2's byte-level BPE (``tokenizers.Tokenizer``) from ``vocab.json`` + ``merges.txt``; the
    vocabulary's ``<|...|>`` entries (``<|endoftext|>``) are special tokens, never split."""
    hf = hf_tokenizers()
    for path in (vocab_file, merge_file):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GPT-2 BPE file {path!r} does not exist; pass vocab.json and merges.txt")
    try:
        tok = hf.Tokenizer(hf.models.BPE.from_file(vocab_file, merge_file))
        with open(vocab_file, encoding="utf-8") as f:
            specials = [t for t in json.load(f) if t.startswith("<|") and t.endswith("|>")]
    except Exception as e:  # tokenizers raises its own Exception types on a malformed file
        raise ValueError(f"{vocab_file!r} + {merge_file!r} are not a GPT-2 vocab.json + merges.txt ({e})") from None
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf.decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


def tokenizer_kinds() -> dict[str, type[Tokenizer]]:
    """Every kind a reference may name -> its class (the Megatron-LM kinds live in ``tokenizer_types``)."""
    from tpzoo.data.tokenizer_types import MEGATRON_KINDS

    return {"sentencepiece": SentencePieceTokenizer, "huggingface": HFTokenizer, **MEGATRON_KINDS}


def load_tokenizer(path: str | os.PathLike | None = None, sha256: str | None = None, kind: str | None = None,
                   **options: Any) -> Tokenizer:
    """Load a tokenizer: a ``reference()`` (``load_tokenizer(**ref)``: its ``kind`` and options), or
    by ``path`` alone a sentencepiece ``.model`` file, a ``tokenizer.json``, or a folder with either
    (e.g. a converted Hugging Face checkpoint). With ``sha256`` raise ValueError if the files have
    changed. Keys a kind does not take (``vocab_size`` of a file's kind ...) are ignored."""
    if kind is not None and kind not in ("sentencepiece", "huggingface"):
        kinds = tokenizer_kinds()
        if kind not in kinds:
            raise ValueError(f"tokenizer kind {kind!r} is unknown; known kinds: {', '.join(kinds)}")
        params = inspect.signature(kinds[kind]).parameters
        tok = kinds[kind](**{k: v for k, v in {"path": path, **options}.items() if k in params})
    else:
        tok = _load_path(str(path), bos=bool(options.get("bos")))
    if sha256 is not None and tok.sha256 != sha256:
        raise ValueError(
            f"tokenizer {tok.path!r} has sha256 {tok.sha256[:12]}, not the recorded {sha256[:12]}; "
            "it changed since it was recorded: restore the original file"
        )
    return tok


def _load_path(path: str, bos: bool = False) -> Tokenizer:
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer {path!r} does not exist; pass a sentencepiece .model file or a folder")
    if os.path.isdir(path):
        if (found := _in_folder(path)) is not None:
            return HFTokenizer(found) if found == path else SentencePieceTokenizer(found, bos)
        raise FileNotFoundError(
            f"folder {path!r} holds no tokenizer.json, vocab.json+merges.txt or sentencepiece .model file"
        )
    return HFTokenizer(path) if path.endswith(".json") else SentencePieceTokenizer(path, bos)


def _in_folder(path: str) -> str | None:
    """What of the folder ``path`` is its tokenizer: ``path`` itself (a Hugging Face one: tokenizer.json, or GPT-2's
    vocab.json + merges.txt), its first sentencepiece ``.model`` file, or None."""
    names = set(os.listdir(path))
    if "tokenizer.json" in names or {"vocab.json", "merges.txt"} <= names:
        return path
    models = sorted(n for n in names if n.endswith(".model"))
    return os.path.join(path, models[0]) if models else None


def folder_holds_tokenizer(path: str | os.PathLike) -> bool:
    """Whether the folder ``path`` holds a tokenizer ``load_tokenizer(path)`` reads."""
    return os.path.isdir(path) and _in_folder(str(path)) is not None


def recorded_tokenizer(reference: dict[str, Any] | None) -> Tokenizer | None:
    """The tokenizer a checkpoint or dataset ``reference`` names, or None when there is none or
    its files are not on this machine (ValueError when they changed since)."""
    if not reference:
        return None
    files = [v for k, v in reference.items() if k in ("path", "merge_file") and v]
    if not all(os.path.exists(f) for f in files):
        return None
    return load_tokenizer(**reference)


def _sentences(source: Any, key: str) -> Iterable[str]:
    for text in iter_texts(source, key):
        yield from (line for line in text.splitlines() if line.strip())


def train_tokenizer(
    source: Any,
    model_prefix: str,
    vocab_size: int,
    model_type: str = "bpe",
    key: str = "text",
    max_sentences: int = 2_000_000,
    character_coverage: float = 1.0,
) -> str:
    """Train a sentencepiece model on ``source`` (paths/globs/folders of json/jsonl/txt/parquet/csv
    files, or a ``datasets`` Dataset) and return the path ``MODEL_PREFIX.model``.

    Ids 0-5 are ``[PAD] <unk> <eod> [CLS] [SEP] [MASK]``; the first ``max_sentences`` lines are used.
    """
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    n_special = len(SPECIAL_PIECES)
    if vocab_size <= n_special:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room beside the {n_special} special tokens "
            f"({' '.join(SPECIAL_PIECES.values())}); use a vocab_size of a few hundred or more"
        )
    lines = []
    for line in _sentences(source, key):
        lines.append(line)
        if len(lines) >= max_sentences:
            break
    if not lines:
        raise ValueError(f"the corpus {source!r} is empty: it holds no text to train a tokenizer on")
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=model_prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            pad_id=0,
            pad_piece=SPECIAL_PIECES["pad"],
            unk_id=1,
            unk_piece=SPECIAL_PIECES["unk"],
            bos_id=-1,
            eos_id=2,
            eos_piece=SPECIAL_PIECES["eod"],
            control_symbols=[SPECIAL_PIECES[k] for k in ("cls", "sep", "mask")],
            num_threads=1,
            minloglevel=2,
            max_sentence_length=1 << 16,
        )
    except RuntimeError as e:
        reason = str(e).split("] ", 1)[-1]  # drop sentencepiece's source location and assertion
        raise ValueError(
            f"sentencepiece cannot train a {vocab_size}-token {model_type} model on this corpus: {reason}"
        ) from None
    return model_prefix + ".model"
