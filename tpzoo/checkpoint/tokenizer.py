"""The tokenizer a saved model was trained with: the one its training checkpoint records (meta.json:
path and sha256), or one inside its model folder (``tokenizer.json`` or a sentencepiece ``.model``).

    tokenizer = model_tokenizer("runs/gpt", vocab_size=model.config.vocab_size)
    tokenizer = model_tokenizer("runs/gpt", "other.model", vocab_size=...)   # --tokenizer-model given

No function here needs a process group.
"""

from __future__ import annotations

from pathlib import Path

from tpzoo.checkpoint.paths import read_meta
from tpzoo.data.tokenizer import Tokenizer, load_tokenizer, recorded_tokenizer
from tpzoo.models.pretrained import CONFIG_FILE


def model_tokenizer(path: str | Path, tokenizer_model: str | None = None, *, vocab_size: int | None = None
                    ) -> Tokenizer:
    """``tokenizer_model`` if given, else the tokenizer the checkpoint at ``path`` records, else one
    inside the model folder ``path``. ValueError when ``path`` names none, or when the tokenizer's
    vocabulary is not the model's ``vocab_size`` (both sizes named): its ids would mean other tokens."""
    if tokenizer_model:
        tokenizer = load_tokenizer(tokenizer_model)
    elif not (Path(path) / CONFIG_FILE).is_file() and "tokenizer" in (meta := read_meta(path)):
        recorded = meta["tokenizer"]
        tokenizer = recorded_tokenizer(recorded)  # a NullTokenizer has no files: always on this machine
        if tokenizer is None:
            raise ValueError(f"{path} was trained with the tokenizer {recorded.get('path')}, which is not on this "
                             f"machine; pass --tokenizer-model FILE (a copy of it)")
    else:
        try:
            tokenizer = load_tokenizer(path)
        except FileNotFoundError:
            raise ValueError(f"{path} names no tokenizer and holds none; pass --tokenizer-model FILE (the one the "
                             f"model was trained with)") from None
    if vocab_size is not None and tokenizer.vocab_size != vocab_size:
        raise ValueError(f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model's vocabulary "
                         f"has {vocab_size}; pass the --tokenizer-model the model was trained with")
    return tokenizer
