"""GPT (the GPT-2 architecture): learned positions, pre-LN causal layers, a final LayerNorm, and an
output layer tied to the word embeddings, every matrix multiply tensor-parallel.

    model = GPTModel(get_preset("gpt2"))
    logits = model(input_ids)                  # [b, s, V] over the real vocabulary (gathered)
    loss = model(input_ids, labels=labels)     # [b, s] per-token loss, vocabulary never gathered

``labels`` are aligned with the positions (labels[:, t] is the target of position t, i.e. the
next token; -100 = ignore), as in Megatron-LM; Hugging Face's ``labels=input_ids`` equals
``labels = input_ids[:, 1:]`` padded with -100 here.
"""

from __future__ import annotations

from torch import Tensor, nn

from tpzoo.models.base import StagedModel
from tpzoo.models.config import TransformerConfig
from tpzoo.models.embedding import Embedding, add_output_weight, lm_output, output_weight, vocab_parallel_logits
from tpzoo.models.kv_cache import KVCache
from tpzoo.models.transformer import LayerNorm
from tpzoo.parallel import ParallelMesh


class GPTHead(nn.Module):
    """final_layernorm, then logits against the output weight [V'/tp, h] (vocab-parallel): the word
    embedding's, passed in by the model, unless untied or on a last stage (``add_output_weight``)."""

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh, has_embedding: bool) -> None:
        super().__init__()
        self.config, self.mesh = config, mesh
        self.final_layernorm = LayerNorm(config.hidden_size, config.layernorm_epsilon, config.sequence_parallel,
                                         config.kernels)
        add_output_weight(self, config, mesh, has_embedding)

    def forward(self, hidden: Tensor, labels: Tensor | None, embedding_weight: Tensor | None = None) -> Tensor:
        hidden = self.final_layernorm(hidden)
        logits = vocab_parallel_logits(hidden, output_weight(self, self.config, embedding_weight), None, self.mesh,
                                       self.config.sequence_parallel)
        return lm_output(logits, labels, self.config.vocab_size, self.mesh)


class GPTModel(StagedModel):
    """GPT-2: ``embedding`` (word + position), ``layers`` (pre-LN, causal), ``head`` (final LN, tied output).

    forward(input_ids [b, s], labels [b, s] | None) -> logits [b, s, V] | per-token loss [b, s].
    A stage without pre_process takes hidden states [b, s(/tp), h] in place of input_ids; one
    without post_process returns them. See ``StagedModel`` for mesh, stages and seeds.
    """

    model_type = "gpt"
    ties_output_to_embedding = True

    def build_embedding(self) -> nn.Module:
        return Embedding(self.config, self.mesh)

    def build_head(self) -> nn.Module:
        return GPTHead(self.config, self.mesh, has_embedding=self.pre_process)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """``cache``: decode incrementally; input_ids are the tokens after the cached ones (whole model only)."""
        if cache is not None and not self.is_whole:
            raise ValueError("a KV cache needs the whole model (pre_process, post_process and every layer)")
        offset = cache.length if cache is not None else 0
        hidden = self.embedding(input_ids, position_offset=offset) if self.pre_process else input_ids
        hidden = self.run_layers(hidden, None, cache)
        if cache is not None:
            cache.length += input_ids.shape[1]
        if not self.post_process:
            return hidden
        tied = self.embedding.word_embeddings.weight if self.pre_process and self.config.tie_word_embeddings else None
        return self.head(hidden, labels, tied)
