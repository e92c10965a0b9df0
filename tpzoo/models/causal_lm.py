"""``CausalLM``: the decoder every causal family builds from its config's traits (GPT, Llama), with
incremental decoding through a ``KVCache``; ``DECODER_PLAN`` is its sharding plan. ``SequenceClassifier``
makes a family's decoder a classifier (``CLASSIFIER_PLAN``), as Hugging Face's ``...ForSequenceClassification``.

    logits = model(input_ids)                  # [b, s, V]
    loss = model(input_ids, labels=labels)     # [b, s] per-token loss
    loss = model(input_ids, labels=labels, document_ids=docs)   # packed examples, each as if alone
    clf = GPTForSequenceClassification(config)               # config.num_labels classes
    logits = clf(input_ids, attention_mask=mask)             # [b, num_labels], read at the last real token
    loss = clf(input_ids, attention_mask=mask, labels=y)     # per-example loss [b]

``document_ids`` [b, s] (packed examples: the example of each token, in runs) keep each example to itself:
attention within its run only (``document_mask``) and learned positions counted from its start
(``document_positions``); rotary positions stay absolute, which changes nothing inside a run, since rotary scores
depend only on the distance between query and key. ``position_ids`` [b, s] or [s] give each token's position
(learned and rotary) instead, and ``sequence_index`` [s] each token's index in the whole sequence, for a rank of
context parallelism that holds pieces of it (the engine's cut gives both; ``tpzoo.placement``). ``labels`` are
aligned with the positions (labels[:, t] is the target of position t, i.e. the next token; -100 = ignore), as in
Megatron-LM; Hugging Face's ``labels=input_ids`` equals ``labels = input_ids[:, 1:]`` padded with -100 here.

What a layer is comes from the config (``ModelConfig``'s traits): learned or rotary positions
(``position_embedding_type``), LayerNorm or RMSNorm (``normalization``), the MLP's ``activation``,
biases (``add_bias_linear``; ``add_qkv_bias`` on q, k, v alone), grouped-query attention
(``num_query_groups``), the head size (``kv_channels``), a norm on queries and keys (``qk_layernorm``), a
sliding window (``window_size``), scaled rotary frequencies (``rope_scaling_parameters``), pre-norm
layers, a final norm and an LM head, tied to the word embedding or not. A family sets its config class, its
plan and, where it differs, ``output_init_std`` (GPT-2 scales the projections into the residual
stream by 1 / sqrt(2 num_layers)).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from tpzoo.models.attention import Attention, document_mask
from tpzoo.models.base import StagedModel
from tpzoo.models.embedding import EMBEDDING_PLAN, Embedding, document_positions
from tpzoo.models.heads import LM_HEAD_PLAN, LastTokenHead, LMHead
from tpzoo.models.kv_cache import KVCache
from tpzoo.models.mlp import MLP
from tpzoo.models.rope import Llama3Scaling, RotaryEmbedding
from tpzoo.models.transformer import LAYER_PLAN, TransformerLayer
from tpzoo.placement import Placement
from tpzoo.sharding_plan import ShardingPlan, prefixed

DECODER_PLAN = ShardingPlan({**prefixed("embedding", EMBEDDING_PLAN), **prefixed("layers.*", LAYER_PLAN),
                             **prefixed("head", LM_HEAD_PLAN)},
                            tp_divides=("num_attention_heads", "num_query_groups", "ffn_hidden_size"))
# the classifier's head reads one token of the whole sequence: gathered under sequence parallelism, kept whole
CLASSIFIER_PLAN = ShardingPlan({**prefixed("embedding", EMBEDDING_PLAN), **prefixed("layers.*", LAYER_PLAN),
                                "head": "gather"}, tp_divides=DECODER_PLAN.tp_divides)


class CausalLM(StagedModel):
    """forward(input_ids [b, s], labels [b, s] | None, cache) -> logits [b, s, V] | per-token loss [b, s].

    A stage without pre_process takes hidden states [b, s, h] in place of input_ids; one without
    post_process returns them. See ``StagedModel`` for seeds and stages.
    """

    ties_output_to_embedding: ClassVar[bool] = True
    causal: ClassVar[bool] = True  # token t attends to tokens <= t
    sharding = DECODER_PLAN

    def output_init_std(self) -> float:
        """The init std of the projections into the residual stream (attention output, second MLP linear)."""
        return self.config.init_method_std

    def build_embedding(self) -> nn.Module:
        c = self.config
        learned = c.position_embedding_type == "learned_absolute"
        return Embedding(c.vocab_size, c.hidden_size, max_positions=c.max_position_embeddings if learned else None,
                         dropout=c.hidden_dropout, init_std=c.init_method_std, max_sequence=c.max_position_embeddings)

    def build_layer(self, layer_number: int) -> nn.Module:
        c, out_std = self.config, self.output_init_std()
        rotary = None
        if c.position_embedding_type == "rope":
            if getattr(c, "rotary_base", None) is None:
                raise ValueError(f"{type(c).__name__} has rotary positions but no rotary_base; give the config a "
                                 f"rotary_base field (Hugging Face's rope_theta, e.g. 10000.0)")
            scaling = getattr(c, "rope_scaling_parameters", lambda: None)()
            rotary = RotaryEmbedding(c.head_dim, c.rotary_base, c.max_position_embeddings,
                                     fraction=getattr(c, "rotary_percent", 1.0),
                                     scaling=Llama3Scaling(**scaling) if scaling else None)
        attention = Attention(c.hidden_size, c.num_attention_heads, num_query_groups=c.query_groups,
                              head_dim=c.head_dim, causal=self.causal, window=c.window_size,
                              dropout=c.attention_dropout, qkv_bias=c.add_bias_linear or c.add_qkv_bias,
                              out_bias=c.add_bias_linear, rotary=rotary,
                              qk_norm=c.normalization if c.qk_layernorm else None, norm_epsilon=c.layernorm_epsilon,
                              init_std=c.init_method_std, out_init_std=out_std, layer_number=layer_number)
        return TransformerLayer(attention, self.build_mlp(layer_number), self.norm(), self.norm(),
                                dropout=c.hidden_dropout)

    def build_mlp(self, layer_number: int) -> nn.Module:
        """The MLP of layer ``layer_number``: the config's dense ``MLP`` (a mixture of experts in Mixtral)."""
        c = self.config
        return MLP(c.hidden_size, c.ffn_size, activation=c.activation, bias=c.add_bias_linear,
                   init_std=c.init_method_std, out_init_std=self.output_init_std())

    def build_head(self) -> nn.Module:
        return LMHead(self.norm(), self.config.vocab_size)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, cache: KVCache | None = None,
                document_ids: Tensor | None = None, position_ids: Tensor | None = None,
                sequence_index: Tensor | None = None) -> Tensor:
        """``cache``: decode incrementally; input_ids are the tokens after the cached ones (whole model only).
        ``document_ids``, ``position_ids``, ``sequence_index``: packed examples, the tokens' positions and places
        (see module docstring)."""
        if cache is not None and not self.is_whole:
            raise ValueError("a KV cache needs the whole model (pre_process, post_process and every layer)")
        if cache is not None and (document_ids, position_ids, sequence_index) != (None, None, None):
            raise ValueError("document_ids, position_ids and sequence_index are for training on whole or packed "
                             "sequences; decode without them")
        offset = cache.length if cache is not None else 0
        if self.pre_process:
            positions = position_ids
            if positions is None and document_ids is not None:
                positions = document_positions(document_ids)
            hidden = self.embedding(input_ids, position_offset=offset, position_ids=positions)
        else:
            hidden = input_ids
        if position_ids is None and sequence_index is None:
            mask = None if document_ids is None else document_mask(document_ids)
        else:
            index = sequence_index if sequence_index is not None else \
                torch.arange(position_ids.shape[-1], device=position_ids.device)
            mask = Placement(index, document_ids, positions=position_ids)
        hidden = self.run_layers(hidden, mask, cache)
        if cache is not None:
            cache.length += input_ids.shape[1]
        if not self.post_process:
            return hidden
        return self.head(hidden, labels, self.tied_weight())


class SequenceClassifier:
    """Mixed in before a family's decoder (``class GPTForSequenceClassification(SequenceClassifier, GPTModel)``):
    its embedding and layers, and a ``LastTokenHead`` (final norm, ``score`` [num_labels, h]) in place of the LM
    head. Sequences are padded on the right; ``attention_mask`` (1 = token, 0 = padding) says where each ends.

    forward(input_ids [b, s] (or a stage's hidden states), attention_mask [b, s] | None, labels [b] | None) ->
    logits [b, num_labels] | the per-example cross entropy [b] (float32).
    """

    sharding = CLASSIFIER_PLAN
    ties_output_to_embedding = False

    def build_head(self) -> nn.Module:
        c = self.config
        return LastTokenHead(self.norm(), c.hidden_size, c.num_labels, c.init_method_std)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None) -> Tensor:
        hidden = self.embedding(input_ids) if self.pre_process else input_ids
        hidden = self.run_layers(hidden)
        return self.head(hidden, labels, attention_mask) if self.post_process else hidden
