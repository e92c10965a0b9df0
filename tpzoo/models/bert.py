"""BERT: word + position + token-type embeddings, post-LN bidirectional layers with a padding mask, and
the heads; plain PyTorch from the block library, split by ``BERT_PLAN`` / ``CLASSIFIER_PLAN``.

    model = BertModel(get_preset("bert-base"))
    logits = model(input_ids, token_type_ids, attention_mask)          # MLM logits [b, s, V]
    loss = model(input_ids, token_type_ids, attention_mask, labels)    # per-token MLM loss [b, s]
    mlm, nsp = model(input_ids, ..., return_binary_logits=True)        # + next-sentence logits [b, 2]
    mlm, nsp = model(input_ids, ..., labels, next_sentence_label=y)   # per-token [b, s], per-sequence [b] loss

    clf = BertForSequenceClassification(config)                        # config.num_labels classes
    logits = clf(input_ids, token_type_ids, attention_mask)            # [b, num_labels]
    loss = clf(input_ids, token_type_ids, attention_mask, labels=y)    # per-example loss [b]

attention_mask: 1 = token, 0 = padding (Hugging Face's convention); labels: -100 = no MLM target;
next_sentence_label [b]: 0 = B follows A, 1 = B is random or swapped, -100 = no target. The
next-sentence (or sentence-order) logits come from the pooled first token, as in Hugging Face's
BertForPreTraining; the pretraining loss adds their mean cross entropy (over the sequences) to the
mean MLM loss (over the masked tokens), as Megatron's lm_loss + sop_loss. Under sequence parallelism
the MLM head runs on the sequence shards (its dense and LayerNorm weights replicated, as Megatron-LM's),
the pooler gathers the sequence first and the small heads after it stay whole.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo.models.attention import Attention, padding_mask
from tpzoo.models.base import StagedModel
from tpzoo.models.config import TransformerConfig
from tpzoo.models.embedding import EMBEDDING_PLAN, Embedding
from tpzoo.models.bert_hf import HF, num_parameters
from tpzoo.models.families import FamilySpec
from tpzoo.models.heads import MLM_HEAD_PLAN, OUTPUT_WEIGHT_PLAN, ClassificationHead, MLMHead, Pooler, output_weight
from tpzoo.models import weights
from tpzoo.models.mlp import MLP, gelu_approximation
from tpzoo.models.norms import norm
from tpzoo.models.transformer import LAYER_PLAN, TransformerLayer
from tpzoo.sharding_plan import ShardingPlan, prefixed
from tpzoo.placement import Placement

ENCODER_PLAN = ShardingPlan({**prefixed("embedding", EMBEDDING_PLAN), **prefixed("layers.*", LAYER_PLAN)},
                            tp_divides=("num_attention_heads", "ffn_hidden_size"))
BERT_PLAN = ENCODER_PLAN | ShardingPlan({**prefixed("head.lm_head", MLM_HEAD_PLAN),
                                         **prefixed("head", OUTPUT_WEIGHT_PLAN), "head.pooler": "gather",
                                         "head.binary_head": "replicated"})
CLASSIFIER_PLAN = ENCODER_PLAN | ShardingPlan({"head": "gather"})


class BertHead(nn.Module):
    """``lm_head`` (MLM) and, with ``add_binary_head``, ``pooler`` + ``binary_head`` [2, h] (NSP / SOP). The pooler
    reads the first token; ``first``: whether this rank holds it (a bool tensor; None: it does), where context
    parallelism splits the sequence: the others' binary losses are 0, so summed over the cp ranks they count once."""

    def __init__(self, config: TransformerConfig, add_binary_head: bool) -> None:
        super().__init__()
        c = config
        self.lm_head = MLMHead(c.hidden_size, c.vocab_size, norm(c.normalization, c.hidden_size, c.layernorm_epsilon),
                               approximate=gelu_approximation(c.activation), init_std=c.init_method_std)
        if add_binary_head:
            self.pooler = Pooler(c.hidden_size, c.init_method_std)
            self.binary_head = weights.linear(c.hidden_size, 2, True, c.init_method_std)

    def forward(self, hidden: Tensor, labels: Tensor | None, embedding_weight: Tensor | None,
                return_binary_logits: bool = False, next_sentence_label: Tensor | None = None,
                first: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        out = self.lm_head(hidden, output_weight(self, embedding_weight), labels)
        if not return_binary_logits and next_sentence_label is None:
            return out
        if not hasattr(self, "binary_head"):
            raise ValueError("return_binary_logits=True or next_sentence_label needs a BertModel built with "
                             "add_binary_head=True")
        logits = self.binary_head(self.pooler(hidden))                            # [b, 2]
        if next_sentence_label is None:
            return out, logits
        if labels is None or next_sentence_label.shape != hidden.shape[:1]:
            raise ValueError(f"next_sentence_label must be [b] = [{hidden.shape[0]}] and come with the MLM labels, "
                             f"got {tuple(next_sentence_label.shape)} with labels={labels is not None}")
        binary = F.cross_entropy(logits.float(), next_sentence_label, reduction="none")
        return out, binary if first is None else binary * first


class _BertBase(StagedModel):
    """Embedding (word + position + token type, then LayerNorm) and post-LN bidirectional layers."""

    model_type = "bert"
    config_class = TransformerConfig
    causal = False  # every token attends to every non-padding token

    def build_embedding(self) -> nn.Module:
        c = self.config
        return Embedding(c.vocab_size, c.hidden_size, max_positions=c.max_position_embeddings,
                         type_vocab_size=c.type_vocab_size, norm=self.norm(), dropout=c.hidden_dropout,
                         init_std=c.init_method_std)

    def build_layer(self, layer_number: int) -> nn.Module:
        c = self.config
        attention = Attention(c.hidden_size, c.num_attention_heads, causal=self.causal, dropout=c.attention_dropout,
                              init_std=c.init_method_std, out_init_std=c.init_method_std, layer_number=layer_number)
        mlp = MLP(c.hidden_size, c.ffn_size, activation=c.activation, init_std=c.init_method_std,
                  out_init_std=c.init_method_std)
        return TransformerLayer(attention, mlp, self.norm(), self.norm(), dropout=c.hidden_dropout, residual="post")

    def encode(self, x: Tensor, token_type_ids: Tensor | None, attention_mask: Tensor | None,
               position_ids: Tensor | None = None, sequence_index: Tensor | None = None) -> Tensor:
        """Embedding (first stage) and this model's layers: [b, s] ids or [b, s, h] -> [b, s, h]. ``position_ids``
        and ``sequence_index``: the tokens' positions and places in the whole sequence (context parallelism holds a
        piece of it; ``tpzoo.models.causal_lm``)."""
        if token_type_ids is not None and not self.pre_process:
            token_type_ids = None  # only the embedding reads them; later stages may be handed them anyway
        hidden = self.embedding(x, token_type_ids, position_ids=position_ids) if self.pre_process else x
        if sequence_index is None:
            return self.run_layers(hidden, padding_mask(attention_mask))
        valid = None if attention_mask is None else attention_mask != 0
        return self.run_layers(hidden, Placement(sequence_index, valid=valid, positions=position_ids))


class BertModel(_BertBase):
    """BERT for pretraining: ``embedding``, ``layers`` (post-LN, padding mask), ``head`` (MLM tied to the
    word embeddings; with ``add_binary_head`` the pooler and the NSP/SOP head, as BertForPreTraining).

    forward(input_ids [b, s], token_type_ids [b, s] | None, attention_mask [b, s] | None,
    labels [b, s] | None, return_binary_logits=False, next_sentence_label [b] | None) -> MLM logits
    [b, s, V] | per-token loss [b, s], or (that, binary logits [b, 2]); with labels and
    next_sentence_label (per-token MLM loss [b, s], per-sequence binary loss [b]), float32, 0 where
    a label is -100: one loss per label key of ``label_keys`` given (labels, and next_sentence_label with
    the binary head), in that order (the engine divides each by its global count). Stages: see ``StagedModel``.
    """

    ties_output_to_embedding = True
    sharding = BERT_PLAN
    first_token_labels = ("next_sentence_label",)  # scored by the cp rank holding the first token (BertHead)

    def __init__(self, config: TransformerConfig, *, add_binary_head: bool = True, **stage: Any) -> None:
        self.add_binary_head = add_binary_head
        self.label_keys = ("labels", "next_sentence_label") if add_binary_head else ("labels",)
        super().__init__(config, **stage)

    def build_head(self) -> nn.Module:
        return BertHead(self.config, self.add_binary_head)

    @classmethod
    def loss_names(cls, data: object) -> dict[str, str]:
        """``mlm_loss``, and the binary head's after the sentence task of ``data`` (``BertDataset.binary_head``):
        ``sop_loss`` (sentence order, the default) or ``nsp_loss`` (next sentence); none without one."""
        binary = getattr(data, "binary_head", "sop")
        return {"labels": "mlm_loss", **({"next_sentence_label": f"{binary}_loss"} if binary else {})}

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, return_binary_logits: bool = False,
                next_sentence_label: Tensor | None = None, position_ids: Tensor | None = None,
                sequence_index: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        hidden = self.encode(input_ids, token_type_ids, attention_mask, position_ids, sequence_index)
        if not self.post_process:
            return hidden
        first = None if sequence_index is None else sequence_index[0] == 0  # this cp rank holds [CLS]
        return self.head(hidden, labels, self.tied_weight(), return_binary_logits, next_sentence_label, first)


class BertForSequenceClassification(_BertBase):
    """BERT with a classification head for fine-tuning: ``head`` = pooler + dropout + classifier.

    forward(input_ids, token_type_ids=None, attention_mask=None, labels [b] | None) -> logits
    [b, config.num_labels] | per-example cross-entropy loss [b].
    """

    sharding = CLASSIFIER_PLAN

    def build_head(self) -> nn.Module:
        c = self.config
        return ClassificationHead(c.hidden_size, c.num_labels, dropout=c.hidden_dropout, init_std=c.init_method_std)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> Tensor:
        hidden = self.encode(input_ids, token_type_ids, attention_mask)
        if not self.post_process:
            return hidden
        return self.head(hidden, labels)


SPEC = FamilySpec(pretrain_model="BertModel",
                  finetune_model="BertForSequenceClassification", classifier_model="BertForSequenceClassification",
                  num_parameters=num_parameters,
                  models={"BertModel": BertModel, "BertForSequenceClassification": BertForSequenceClassification},
                  model_options=lambda model: {"add_binary_head": model.add_binary_head}
                  if isinstance(model, BertModel) else {},
                  hf=HF)
