"""Packed documents in a causal-LM sample: Megatron-LM's ``--reset-position-ids``, ``--reset-attention-mask`` and
``--eod-mask-loss``. A GPT sample is a window of the token stream, so it may hold the end of one document, whole
ones and the start of another, each ended by the end-of-document id (eod). Each token belongs to the document its
run of tokens ends with (the eod with the document it ends):

    input_ids     a  b  EOD  c  d  e  EOD  f
    document_ids  0  0  0    1  1  1  1    2       --reset-attention-mask: no token attends to another document
    position_ids  0  1  2    0  1  2  3    0       --reset-position-ids: positions restart at each document
    labels        b EOD -100 d  e EOD -100 g       --eod-mask-loss: no loss where the input is the eod (the target
                                                   would be the next document's first token)

``document_ids`` and ``position_ids`` travel with the batch to the model (``tpzoo.models.causal_lm``) and, under
context parallelism, with each rank's pieces (``tpzoo.engine.context_cut``); the mask is built from the ids, never
held as a dense [s, s] tensor per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tpzoo.models.embedding import document_positions


@dataclass(frozen=True)
class DocumentMarks:
    """What a sample says of its documents (module docstring); ``eod``: the tokenizer's end-of-document id."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.eod, bool) or not isinstance(self.eod, int) or self.eod < 0:
            raise ValueError(f"the end-of-document id must be an int >= 0, got {self.eod!r}; the document flags need "
                             f"a tokenizer with an eod token")

    @property
    def active(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    def __call__(self, sample: dict[str, Tensor]) -> dict[str, Tensor]:
        """``sample`` ({"input_ids": [s], "labels": [s]}) with the keys the flags add or change."""
        ids = sample["input_ids"]
        ends = ids == self.eod
        docs = torch.cumsum(ends, 0) - ends.long()  # the eods before each token: an eod closes its own document
        out = dict(sample)
        if self.reset_attention_mask:
            out["document_ids"] = docs
        if self.reset_position_ids:
            out["position_ids"] = document_positions(docs[None])[0]
        elif self.reset_attention_mask:  # the model would restart learned positions with the documents otherwise
            out["position_ids"] = torch.arange(len(ids))
        if self.eod_mask_loss:
            out["labels"] = sample["labels"].masked_fill(ends, -100)
        return out
