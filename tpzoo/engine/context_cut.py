"""The cut of every sequence of a micro-batch over the cp ranks of context parallelism.

A causal model's attention work grows along the sequence (the last query sees every key), so a causal sequence is cut
into 2 cp chunks and rank r holds chunks r and 2cp - 1 - r, the same work on every rank (Megatron-LM's and
torchtitan's load balancing). s = 16, cp = 4:

    chunks   0  1  2  3  4  5  6  7        (2 tokens each)
    rank 0:  0              7              tokens 0 1 14 15
    rank 1:     1        6                 tokens 2 3 12 13
    rank 2:        2  5                    tokens 4 5 10 11
    rank 3:        3  4                    tokens 6 7  8  9

A bidirectional model (BERT) does the same work at every query: rank r holds the r-th of cp contiguous chunks.

Every token-level tensor ([b, s, ...]: ids, labels, masks, token types, documents, positions) is cut alike; the
rank also gets where its tokens sit: ``sequence_index`` [s/cp] and ``position_ids`` (the batch's own, else each
document's positions where ``document_ids`` pack several, else the index), which the model reads
(``tpzoo.models.causal_lm``) and which attention's ``Placement`` carries round the ring. Labels are cut with the
tokens, so each rank's loss is its tokens' share of the global batch's mean (the counts are the whole batch's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpzoo.models.embedding import document_positions
from tpzoo.run_options import context_cut_problem


def held_index(seq_length: int, cp: int, rank: int, balanced: bool) -> Tensor:
    """[s / cp] (long): the indices into the sequence of the tokens cp rank ``rank`` holds (module docstring)."""
    if not balanced:
        size = seq_length // cp
        return torch.arange(rank * size, (rank + 1) * size)
    size = seq_length // (2 * cp)
    first, second = rank * size, (2 * cp - 1 - rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


def cut_sequences(batch: dict[str, Tensor], cp: int, rank: int, balanced: bool, tp_split: int = 1
                  ) -> dict[str, Tensor]:
    """This cp rank's piece of every sequence of ``batch`` (a micro-batch: ``input_ids`` [b, s] and what goes with
    it), with ``sequence_index`` and ``position_ids`` (module docstring)."""
    s = batch["input_ids"].shape[1]
    problem = context_cut_problem(s, cp, balanced, tp_split)
    if problem:
        raise ValueError(problem)
    index = held_index(s, cp, rank, balanced).to(batch["input_ids"].device)
    out = {k: t.index_select(1, index) if t.dim() >= 2 and t.shape[1] == s else t for k, t in batch.items()}
    if "position_ids" not in batch:  # [b, s/cp] like the ids: sequence parallelism cuts the positions' dim 1
        docs = batch.get("document_ids")
        out["position_ids"] = index.expand(len(batch["input_ids"]), -1) if docs is None else \
            document_positions(docs).index_select(1, index)
    out["sequence_index"] = index
    return out
