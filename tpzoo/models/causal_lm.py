"""``CausalLM``: the forward of every decoder family (GPT, Llama): embedding, causal layers, LM head,
with incremental decoding through a ``KVCache``.

    logits = model(input_ids)                  # [b, s, V] over the real vocabulary (gathered)
    loss = model(input_ids, labels=labels)     # [b, s] per-token loss, vocabulary never gathered

``labels`` are aligned with the positions (labels[:, t] is the target of position t, i.e. the
next token; -100 = ignore), as in Megatron-LM; Hugging Face's ``labels=input_ids`` equals
``labels = input_ids[:, 1:]`` padded with -100 here. A family subclasses it with the builders of
``StagedModel`` (the head is an ``LMHead`` with the family's norm); its embedding takes
``position_offset``.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from tpzoo.models.base import StagedModel
from tpzoo.models.embedding import LMHead
from tpzoo.models.kv_cache import KVCache


class CausalLM(StagedModel):
    """forward(input_ids [b, s], labels [b, s] | None, cache) -> logits [b, s, V] | per-token loss [b, s].

    A stage without pre_process takes hidden states [b, s(/tp), h] in place of input_ids; one
    without post_process returns them. See ``StagedModel`` for plan, stages and seeds.
    """

    ties_output_to_embedding: ClassVar[bool] = True
    causal: ClassVar[bool] = True  # token t attends to tokens <= t

    def build_head(self) -> nn.Module:
        """``LMHead``: the family's final norm, then the tied or own output layer."""
        c = self.config
        return LMHead(self.norm(), c.vocab_size, c.hidden_size, self.plan, tied=c.tie_word_embeddings,
                      has_embedding=self.pre_process, init_std=c.init_method_std, pad_to=c.make_vocab_size_divisible_by)

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
