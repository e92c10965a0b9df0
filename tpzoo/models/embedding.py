"""Input embeddings, and the tied output layer that reads the vocabulary back out.

Input:  ids [b, s] -> word (vocab-parallel) [+ learned position] [+ token type] -> [norm] ->
dropout -> [b, s, h], or [b, s/tp, h] with sequence parallelism (the word lookup reduce-scatters
instead of all-reducing, the replicated position/type sum is split to the rank's slice).

Output: rank r holds rows r V'/tp ... of the (padded) word embedding E, so
logits_r = H E_r^T (+ b_r) is [b, s, V'/tp], the rank's slice of the vocabulary. With labels the
per-token loss comes from ``vocab_parallel_cross_entropy`` without gathering the vocabulary;
without, the slices are gathered and cut to the real vocabulary V. ``LMHead`` is the language-model
head of decoders (final norm, then these logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo.models.base import building
from tpzoo.models.transformer import hidden_dropout
from tpzoo.parallel.param_facts import mark
from tpzoo.parallel import (
    ParallelMesh,
    ParallelPlan,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    init_method_normal,
    padded_vocab_size,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)


def word_embeddings(vocab_size: int, hidden_size: int, init_std: float, plan: ParallelPlan, pad_to: int = 128
                    ) -> VocabParallelEmbedding:
    """The [V'/tp, h] vocab-parallel word embedding (also the holder of an untied output weight);
    V' = V rounded up to a multiple of ``pad_to`` x tp (the config's make_vocab_size_divisible_by)."""
    return VocabParallelEmbedding(vocab_size, hidden_size, init_method_normal(init_std),
                                  pad_vocab_to_multiple_of=pad_to, sequence_parallel=plan.sequence_parallel,
                                  tp_group=plan.mesh.tp_group)


def _replicated_embedding(rows: int, hidden_size: int, init_std: float) -> nn.Embedding:
    emb = nn.Embedding(rows, hidden_size)
    nn.init.normal_(emb.weight, mean=0.0, std=init_std)
    return emb


class Embedding(nn.Module):
    """ids [b, s] (+ token types [b, s]) -> [b, s, h] ([b, s/tp, h] with sequence parallelism).

    word_embeddings [V'/tp, h] vocab-parallel; position_embeddings [P, h] (``max_positions``; None:
    no learned positions, e.g. rotary ones in the attention) and token_type_embeddings [T, h]
    (``type_vocab_size`` > 0) replicated; ``norm`` (post-norm models) applied to the sum.
    ``max_sequence``: the longest sequence accepted (default ``max_positions``); ``pad_to``: see
    ``word_embeddings``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, plan: ParallelPlan, *, max_positions: int | None = None,
                 type_vocab_size: int = 0, norm: nn.Module | None = None, hidden_dropout: float = 0.0,
                 init_std: float = 0.02, max_sequence: int | None = None, pad_to: int = 128) -> None:
        super().__init__()
        self.plan, self.hidden_dropout = plan, hidden_dropout
        self.max_sequence = max_sequence or max_positions
        self.word_embeddings = word_embeddings(vocab_size, hidden_size, init_std, plan, pad_to)
        self.position_embeddings = (_replicated_embedding(max_positions, hidden_size, init_std)
                                    if max_positions else None)
        self.token_type_embeddings = (_replicated_embedding(type_vocab_size, hidden_size, init_std)
                                      if type_vocab_size else None)
        self.layernorm = norm

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, position_offset: int = 0) -> Tensor:
        """``position_offset``: the position of input_ids[:, 0] (tokens already decoded, see KVCache)."""
        plan, tp = self.plan, self.plan.tp_size
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        s = input_ids.shape[1]
        if self.max_sequence and position_offset + s > self.max_sequence:
            raise ValueError(f"sequence length {position_offset + s} exceeds max_position_embeddings="
                             f"{self.max_sequence}; feed at most {self.max_sequence} tokens")
        if plan.sequence_parallel and s % tp:
            raise ValueError(f"sequence length {s} is not divisible by tp={tp}: sequence "
                             f"parallelism splits the sequence; use a multiple of {tp}")
        if token_type_ids is not None and self.token_type_embeddings is None:
            raise ValueError("token_type_ids given but the config has type_vocab_size=0")
        x = self.word_embeddings(input_ids)                                   # [b, s(/tp), h]
        extra = None
        if self.position_embeddings is not None:
            extra = self.position_embeddings.weight[position_offset:position_offset + s].unsqueeze(0)  # [1, s, h]
        if self.token_type_embeddings is not None:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            extra = self.token_type_embeddings(types) + (0 if extra is None else extra)  # [b, s, h]
        if extra is not None:
            if plan.sequence_parallel:
                extra = scatter_to_sequence_parallel_region(extra, plan.mesh.tp_group)
            x = x + extra
        if self.layernorm is not None:
            x = self.layernorm(x)
        return hidden_dropout(x, self.hidden_dropout, self.training, plan.mesh, plan.sequence_parallel)


class VocabParallelBias(nn.Module):
    """An output bias over the vocabulary, split like the embedding: [V'/tp], zero (and zero on padding)."""

    def __init__(self, vocab_size: int, tp: int, pad_to: int = 128) -> None:
        super().__init__()
        self.num_embeddings = vocab_size
        self.bias = nn.Parameter(torch.zeros(padded_vocab_size(vocab_size, tp, pad_to) // tp))
        mark(self.bias, tp_split_dim=0, tp_full_size=vocab_size)


def add_output_weight(head: nn.Module, vocab_size: int, hidden_size: int, init_std: float, plan: ParallelPlan, *,
                      tied: bool, has_embedding: bool, pad_to: int = 128) -> None:
    """Give an LM head the output weight [V'/tp, h] that it cannot borrow from the model's embedding.

    Tied and the model holds the embedding: nothing, the model passes the word embedding's weight
    in. Tied on a last pipeline stage without the embedding: ``word_embeddings``, a copy built from
    the embedding's seed, equal to it at init (the pipeline keeps the two in step by summing their
    gradients). Untied: ``output_layer``, a weight of its own.
    """
    if not tied:
        head.output_layer = word_embeddings(vocab_size, hidden_size, init_std, plan, pad_to)
    elif not has_embedding:
        with building(plan.seed, "embedding"):
            head.word_embeddings = word_embeddings(vocab_size, hidden_size, init_std, plan, pad_to)
        mark(head.word_embeddings.weight, pp_tied=True)  # the first stage's weight, copied


def output_weight(head: nn.Module, embedding_weight: Tensor | None) -> Tensor:
    """The weight that ``add_output_weight`` chose: ``embedding_weight`` when tied and given."""
    if hasattr(head, "output_layer"):
        return head.output_layer.weight
    return embedding_weight if embedding_weight is not None else head.word_embeddings.weight


def vocab_parallel_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, mesh: ParallelMesh,
                          sequence_parallel: bool) -> Tensor:
    """hidden [b, s, h] (sequence parallel: [b, s/tp, h]) x weight [V'/tp, h] -> this rank's logits [b, s, V'/tp].

    Each rank's gradient of ``hidden`` is a partial sum over its vocabulary slice: copy_to_tp_region
    all-reduces it, or with sequence parallelism the all-gather of the sequence reduce-scatters it.
    """
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, mesh.tp_group, tensor_parallel_output_grad=True)
    else:
        hidden = copy_to_tp_region(hidden, mesh.tp_group)
    return F.linear(hidden, weight, bias)


def lm_output(logits: Tensor, labels: Tensor | None, vocab_size: int, mesh: ParallelMesh,
              kernels: str | None) -> Tensor:
    """This rank's logits [b, s, V'/tp] -> per-token loss [b, s] (float32, 0 where labels == -100),
    or with no labels the logits over the real vocabulary [b, s, V] (gathered). ``kernels``: the
    plan's tpzoo.kernels backend, which runs the fused cross entropy."""
    if labels is not None:
        return vocab_parallel_cross_entropy(logits, labels, vocab_size=vocab_size, tp_group=mesh.tp_group,
                                            backend=kernels)
    return gather_from_tp_region(logits, mesh.tp_group)[..., :vocab_size]


class LMHead(nn.Module):
    """A decoder's head: ``final_layernorm`` (any norm block), then logits against the output weight
    [V'/tp, h] (vocab-parallel): the word embedding's, passed in by the model, unless untied or on a
    last stage (``add_output_weight``). forward -> per-token loss [b, s] | logits [b, s, V] (``lm_output``)."""

    def __init__(self, norm: nn.Module, vocab_size: int, hidden_size: int, plan: ParallelPlan, *, tied: bool,
                 has_embedding: bool, init_std: float = 0.02, pad_to: int = 128) -> None:
        super().__init__()
        self.plan, self.vocab_size = plan, vocab_size
        self.final_layernorm = norm
        add_output_weight(self, vocab_size, hidden_size, init_std, plan, tied=tied, has_embedding=has_embedding,
                          pad_to=pad_to)

    def forward(self, hidden: Tensor, labels: Tensor | None, embedding_weight: Tensor | None = None) -> Tensor:
        hidden = self.final_layernorm(hidden)
        logits = vocab_parallel_logits(hidden, output_weight(self, embedding_weight), None, self.plan.mesh,
                                       self.plan.sequence_parallel)
        return lm_output(logits, labels, self.vocab_size, self.plan.mesh, self.plan.kernels)
