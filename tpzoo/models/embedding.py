"""Input embeddings, and the tied output layer that reads the vocabulary back out.

Input:  ids [b, s] -> word (vocab-parallel) + learned position (+ token type) -> [LayerNorm] ->
dropout -> [b, s, h], or [b, s/tp, h] with sequence parallelism (the word lookup reduce-scatters
instead of all-reducing, the replicated position/type sum is split to the rank's slice).

Output: rank r holds rows r V'/tp ... of the (padded) word embedding E, so
logits_r = H E_r^T (+ b_r) is [b, s, V'/tp], the rank's slice of the vocabulary. With labels the
per-token loss comes from ``vocab_parallel_cross_entropy`` without gathering the vocabulary;
without, the slices are gathered and cut to the real vocabulary V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo.models.base import building
from tpzoo.models.config import TransformerConfig
from tpzoo.models.transformer import LayerNorm, hidden_dropout
from tpzoo.parallel import (
    ParallelMesh,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    init_method_normal,
    padded_vocab_size,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)


def word_embeddings(config: TransformerConfig, mesh: ParallelMesh) -> VocabParallelEmbedding:
    """The [V'/tp, h] vocab-parallel word embedding (also the holder of an untied output weight)."""
    return VocabParallelEmbedding(config.vocab_size, config.hidden_size, init_method_normal(config.init_method_std),
                                  sequence_parallel=config.sequence_parallel, tp_group=mesh.tp_group)


def _replicated_embedding(rows: int, config: TransformerConfig) -> nn.Embedding:
    emb = nn.Embedding(rows, config.hidden_size)
    nn.init.normal_(emb.weight, mean=0.0, std=config.init_method_std)
    return emb


class Embedding(nn.Module):
    """ids [b, s] (+ token types [b, s]) -> [b, s, h] ([b, s/tp, h] with sequence parallelism).

    word_embeddings [V'/tp, h] vocab-parallel; position_embeddings [P, h] and
    token_type_embeddings [T, h] replicated; layernorm (post-LN models only) replicated.
    """

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh) -> None:
        super().__init__()
        self.config, self.mesh = config, mesh
        self.word_embeddings = word_embeddings(config, mesh)
        self.position_embeddings = _replicated_embedding(config.max_position_embeddings, config)
        self.token_type_embeddings = (_replicated_embedding(config.type_vocab_size, config)
                                      if config.type_vocab_size else None)
        self.layernorm = (LayerNorm(config.hidden_size, config.layernorm_epsilon, config.sequence_parallel,
                                    config.kernels) if config.layernorm_position == "post" else None)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, position_offset: int = 0) -> Tensor:
        """``position_offset``: the position of input_ids[:, 0] (tokens already decoded, see KVCache)."""
        c = self.config
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        s = input_ids.shape[1]
        if position_offset + s > c.max_position_embeddings:
            raise ValueError(f"sequence length {position_offset + s} exceeds max_position_embeddings="
                             f"{c.max_position_embeddings}; feed at most {c.max_position_embeddings} tokens")
        if c.sequence_parallel and s % self.mesh.tp_size:
            raise ValueError(f"sequence length {s} is not divisible by tp={self.mesh.tp_size}: sequence "
                             f"parallelism splits the sequence; use a multiple of {self.mesh.tp_size}")
        if token_type_ids is not None and self.token_type_embeddings is None:
            raise ValueError("token_type_ids given but the config has type_vocab_size=0")
        words = self.word_embeddings(input_ids)                               # [b, s(/tp), h]
        extra = self.position_embeddings.weight[position_offset:position_offset + s].unsqueeze(0)  # [1, s, h]
        if self.token_type_embeddings is not None:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            extra = extra + self.token_type_embeddings(types)                 # [b, s, h]
        if c.sequence_parallel:
            extra = scatter_to_sequence_parallel_region(extra, self.mesh.tp_group)
        x = words + extra
        if self.layernorm is not None:
            x = self.layernorm(x)
        return hidden_dropout(x, c.hidden_dropout, self.training, self.mesh, c.sequence_parallel)


class VocabParallelBias(nn.Module):
    """An output bias over the vocabulary, split like the embedding: [V'/tp], zero (and zero on padding)."""

    def __init__(self, vocab_size: int, tp: int) -> None:
        super().__init__()
        self.num_embeddings = vocab_size
        self.bias = nn.Parameter(torch.zeros(padded_vocab_size(vocab_size, tp) // tp))
        self.bias.tp_shard_dim = 0  # a shard, as tpzoo.parallel marks its layers' shards


def add_output_weight(head: nn.Module, config: TransformerConfig, mesh: ParallelMesh, has_embedding: bool) -> None:
    """Give an LM head the output weight [V'/tp, h] that it cannot borrow from the model's embedding.

    Tied (the default) and the model holds the embedding: nothing, the model passes the word
    embedding's weight in. Tied on a last pipeline stage without the embedding: ``word_embeddings``,
    a copy built from the embedding's seed, equal to it at init (the pipeline keeps the two in
    step by summing their gradients). Untied: ``output_layer``, a weight of its own.
    """
    if not config.tie_word_embeddings:
        head.output_layer = word_embeddings(config, mesh)
    elif not has_embedding:
        with building(config.seed, "embedding"):
            head.word_embeddings = word_embeddings(config, mesh)
        head.word_embeddings.weight.pp_shared = True  # the first stage's weight, copied


def output_weight(head: nn.Module, config: TransformerConfig, embedding_weight: Tensor | None) -> Tensor:
    """The weight that ``add_output_weight`` chose: ``embedding_weight`` when tied and given."""
    if not config.tie_word_embeddings:
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


def lm_output(logits: Tensor, labels: Tensor | None, vocab_size: int, mesh: ParallelMesh) -> Tensor:
    """This rank's logits [b, s, V'/tp] -> per-token loss [b, s] (float32, 0 where labels == -100),
    or with no labels the logits over the real vocabulary [b, s, V] (gathered)."""
    if labels is not None:
        return vocab_parallel_cross_entropy(logits, labels, vocab_size=vocab_size, tp_group=mesh.tp_group)
    return gather_from_tp_region(logits, mesh.tp_group)[..., :vocab_size]
