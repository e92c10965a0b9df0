"""A model's tokenizer in a Hugging Face folder, so that ``AutoTokenizer.from_pretrained(folder)`` opens it.

    copy_tokenizer_files(hf_dir, out)            # from-hf: the folder's tokenizer files travel with the weights
    write_hf_tokenizer(tokenizer, out, 1024)      # to-hf: files copied, or tokenizer.json built

A tokenizer that came from a Hugging Face folder (``tokenizer_config.json`` beside it) is copied file for
file, chat template included. Any other is written as one ``tokenizer.json`` (``PreTrainedTokenizerFast``):
a sentencepiece model through transformers' ``SpmConverter``, which follows the model's own normalizer and
merges, so ``encode(text, add_special_tokens=False)`` gives tpzoo's ids. One difference remains: a special
piece spelled out in the text (``<eod>``) reads as that special token in Hugging Face's tokenizer, as text
pieces in sentencepiece's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tpzoo.data.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer

# The files of a Hugging Face tokenizer, any of which a folder may hold.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
                      "tokenizer.model")
# tpzoo's special ids -> the keyword PreTrainedTokenizerFast names each by.
_SPECIAL_NAMES = {"eod": "eos_token", "pad": "pad_token", "unk": "unk_token", "cls": "cls_token",
                  "sep": "sep_token", "mask": "mask_token"}


def copy_tokenizer_files(source: str | Path, out: str | Path) -> list[str]:
    """Copy the Hugging Face tokenizer files ``source`` holds into ``out``; their names (none: [])."""
    names = [n for n in HF_TOKENIZER_FILES if (Path(source) / n).is_file()]
    for name in names:
        shutil.copyfile(Path(source) / name, Path(out) / name)
    return names


def hugging_face_folder(tokenizer: Tokenizer) -> Path | None:
    """The Hugging Face folder ``tokenizer`` was loaded from (it holds ``tokenizer_config.json``), or None."""
    if not isinstance(tokenizer, HFTokenizer):
        return None
    path = Path(tokenizer.path)
    folder = path if path.is_dir() else path.parent
    return folder if (folder / "tokenizer_config.json").is_file() else None


def fast_tokenizer(tokenizer: Tokenizer) -> Any:
    """A ``tokenizers.Tokenizer`` that encodes like ``tokenizer``; TypeError for a kind that has no text form."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.tok
    if isinstance(tokenizer, SentencePieceTokenizer):
        from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

        proto = import_protobuf().ModelProto()
        proto.ParseFromString(Path(tokenizer.path).read_bytes())
        vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
        # legacy: the dummy prefix before every chunk, as SentencePieceProcessor.encode adds it
        return SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    raise TypeError(f"a {type(tokenizer).__name__} has no vocabulary of text pieces to write for Hugging Face")


def write_hf_tokenizer(tokenizer: Tokenizer, out: str | Path, max_length: int) -> list[str]:
    """Write ``tokenizer`` into the Hugging Face folder ``out`` (``max_length``: the model's positions); the
    names of the files written."""
    if folder := hugging_face_folder(tokenizer):
        return copy_tokenizer_files(folder, out)
    from transformers import PreTrainedTokenizerFast

    pieces = tokenizer.pieces()
    specials = {key: pieces[i] for name, key in _SPECIAL_NAMES.items() if (i := getattr(tokenizer, name)) is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=fast_tokenizer(tokenizer), model_max_length=max_length, **specials)
    written = {Path(f).name for f in fast.save_pretrained(str(out))}
    return [name for name in HF_TOKENIZER_FILES if name in written]
