"""Input embeddings: ids [b, s] -> word [+ learned position] [+ token type] -> [norm] -> dropout -> [b, s, h].

Plain PyTorch. Its plan (``EMBEDDING_PLAN``) splits the word table over tp by rows of the padded
vocabulary (each rank looks its ids up in its slice, the ranks sum), keeps the position and token-type
tables whole and, under sequence parallelism, hands on this rank's slice of the sequence: the word
lookup reduce-scatters instead of summing and the two small tables' outputs are cut to the slice.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tpzoo.models.weights import embedding

EMBEDDING_PLAN = {"word_embeddings": "vocab", "position_embeddings": "scatter", "token_type_embeddings": "scatter",
                  "layernorm": "norm"}


def _table(rows: int, hidden_size: int, std: float) -> nn.Embedding:
    """A small replicated table: torch's nn.Embedding, its weight then drawn again ~ N(0, std^2). The two draws
    are how tpzoo has always made these tables, so a seed gives the weights it gave before."""
    table = nn.Embedding(rows, hidden_size)
    nn.init.normal_(table.weight, mean=0.0, std=std)
    return table


class Embedding(nn.Module):
    """ids [b, s] (+ token types [b, s]) -> [b, s, h].

    word_embeddings [V, h]; position_embeddings [P, h] (``max_positions``; None: no learned positions,
    e.g. rotary ones in the attention); token_type_embeddings [T, h] (``type_vocab_size`` > 0);
    ``norm`` (post-norm models) on the sum; ``dropout`` after it. ``max_sequence``: the longest sequence
    accepted (default ``max_positions``). Tables ~ N(0, ``init_std``^2).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, max_positions: int | None = None, type_vocab_size: int = 0,
                 norm: nn.Module | None = None, dropout: float = 0.0, init_std: float = 0.02,
                 max_sequence: int | None = None) -> None:
        super().__init__()
        self.max_sequence = max_sequence or max_positions
        self.word_embeddings = embedding(vocab_size, hidden_size, init_std)
        self.position_embeddings = _table(max_positions, hidden_size, init_std) if max_positions else None
        self.token_type_embeddings = _table(type_vocab_size, hidden_size, init_std) if type_vocab_size else None
        self.layernorm = norm
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, position_offset: int = 0,
                position_ids: Tensor | None = None) -> Tensor:
        """``position_offset``: the position of input_ids[:, 0] (tokens already decoded, see KVCache);
        ``position_ids`` [b, s]: each token's own position instead (packed examples, ``document_positions``)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        s = input_ids.shape[1]
        if self.max_sequence and position_offset + s > self.max_sequence:
            raise ValueError(f"sequence length {position_offset + s} exceeds max_position_embeddings="
                             f"{self.max_sequence}; feed at most {self.max_sequence} tokens")
        if token_type_ids is not None and self.token_type_embeddings is None:
            raise ValueError("token_type_ids given but the config has type_vocab_size=0")
        x = self.word_embeddings(input_ids)                                   # [b, s, h]
        extra = None
        if self.position_embeddings is not None:
            positions = torch.arange(position_offset, position_offset + s, device=input_ids.device)[None]
            extra = self.position_embeddings(positions if position_ids is None else position_ids)  # [1 | b, s, h]
        if self.token_type_embeddings is not None:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            types = self.token_type_embeddings(types)
            extra = types if extra is None else types + extra                 # [b, s, h]
        if extra is not None:
            x = x + extra
        if self.layernorm is not None:
            x = self.layernorm(x)
        return self.dropout(x)


def document_positions(document_ids: Tensor) -> Tensor:
    """Packed documents: ids [b, s] (the document of each token, runs of equal ids) -> each token's position
    within its document [b, s], counted from 0 where its run starts."""
    b, s = document_ids.shape
    index = torch.arange(s, device=document_ids.device).expand(b, s)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values
