"""BERT: word + position + token-type embeddings, post-LN bidirectional layers with a padding mask,
and the heads, every matrix multiply tensor-parallel.

    model = BertModel(get_preset("bert-base"))
    logits = model(input_ids, token_type_ids, attention_mask)          # MLM logits [b, s, V]
    loss = model(input_ids, token_type_ids, attention_mask, labels)    # per-token MLM loss [b, s]
    mlm, nsp = model(input_ids, ..., return_binary_logits=True)        # + next-sentence logits [b, 2]
    mlm, nsp = model(input_ids, ..., labels, next_sentence_label=y)   # per-token [b, s], per-sequence [b] loss

    clf = BertForSequenceClassification(config)                        # config.num_labels classes
    logits = clf(input_ids, token_type_ids, attention_mask)            # [b, num_labels]
    loss = clf(input_ids, token_type_ids, attention_mask, labels=y)    # per-example loss [b]

attention_mask: 1 = token, 0 = padding (Hugging Face's convention); labels: -100 = no MLM target;
next_sentence_label [b]: 0 = B follows A, 1 = B is random or swapped, -100 = no target.
The next-sentence (or sentence-order) logits come from the pooled first token, as in Hugging
Face's BertForPreTraining; the pretraining loss adds their mean cross entropy (over the sequences)
to the mean MLM loss (over the masked tokens), as Megatron's lm_loss + sop_loss.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo import kernels as K
from tpzoo.models import fused
from tpzoo.models.attention import padding_mask
from tpzoo.models.base import StagedModel
from tpzoo.models.config import TransformerConfig
from tpzoo.models.embedding import (
    Embedding,
    VocabParallelBias,
    add_output_weight,
    lm_output,
    output_weight,
    vocab_parallel_logits,
)
from tpzoo.models.transformer import LayerNorm, hidden_dropout
from tpzoo.parallel import (
    ColumnParallelLinear,
    ParallelMesh,
    RowParallelLinear,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    init_method_normal,
)


def _gather_sequence(hidden: Tensor, config: TransformerConfig, mesh: ParallelMesh) -> Tensor:
    """Sequence-parallel [b, s/tp, h] -> [b, s, h] for the heads (each rank then holds the same full
    gradient, so the backward is a plain split); the identity without sequence parallelism."""
    if not config.sequence_parallel:
        return hidden
    return gather_from_sequence_parallel_region(hidden, mesh.tp_group, tensor_parallel_output_grad=False)


class BertPooler(nn.Module):
    """tanh(dense(hidden[:, 0])): [b, s, h] -> [b, h]; dense column-parallel [h/tp, h], output gathered."""

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.hidden_size, gather_output=True,
                                          init_method=init_method_normal(config.init_method_std),
                                          tp_group=mesh.tp_group)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


def _small_head(config: TransformerConfig, mesh: ParallelMesh, outputs: int) -> RowParallelLinear:
    """A [outputs, h] classifier, row-parallel: each rank multiplies its h/tp input features."""
    return RowParallelLinear(config.hidden_size, outputs, input_is_parallel=False,
                             init_method=init_method_normal(config.init_method_std), tp_group=mesh.tp_group)


class BertLMHead(nn.Module):
    """The MLM head: dense [h/tp, h] column-parallel + GeLU (fused), gathered, LayerNorm, then logits
    against the output weight [V'/tp, h] plus ``bias`` [V'/tp], both vocab-parallel."""

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh) -> None:
        super().__init__()
        self.config, self.mesh = config, mesh
        self.dense = ColumnParallelLinear(config.hidden_size, config.hidden_size, skip_bias_add=True,
                                          init_method=init_method_normal(config.init_method_std),
                                          tp_group=mesh.tp_group)
        self.layernorm = LayerNorm(config.hidden_size, config.layernorm_epsilon, kernels=config.kernels)
        self.output_bias = VocabParallelBias(config.vocab_size, mesh.tp_size)

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor | None) -> Tensor:
        c = self.config
        y, bias = self.dense(hidden)                                              # [b, s, h/tp]
        y = K.bias_gelu(y, bias, fused.gelu_approximate(c.activation), backend=c.kernels)
        y = self.layernorm(gather_from_tp_region(y, self.mesh.tp_group))         # [b, s, h]
        logits = vocab_parallel_logits(y, weight, self.output_bias.bias, self.mesh, sequence_parallel=False)
        return lm_output(logits, labels, c.vocab_size, self.mesh)


class BertHead(nn.Module):
    """``lm_head`` (MLM) and, with ``add_binary_head``, ``pooler`` + ``binary_head`` [2, h] (NSP / SOP)."""

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh, has_embedding: bool,
                 add_binary_head: bool) -> None:
        super().__init__()
        self.config, self.mesh = config, mesh
        self.lm_head = BertLMHead(config, mesh)
        if add_binary_head:
            self.pooler = BertPooler(config, mesh)
            self.binary_head = _small_head(config, mesh, 2)
        add_output_weight(self, config, mesh, has_embedding)

    def forward(self, hidden: Tensor, labels: Tensor | None, embedding_weight: Tensor | None,
                return_binary_logits: bool = False, next_sentence_label: Tensor | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        hidden = _gather_sequence(hidden, self.config, self.mesh)
        out = self.lm_head(hidden, output_weight(self, self.config, embedding_weight), labels)
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
        return out, F.cross_entropy(logits.float(), next_sentence_label, reduction="none")


class BertClassificationHead(nn.Module):
    """pooler, dropout, ``classifier`` [num_labels, h]: hidden [b, s, h] -> logits [b, num_labels]."""

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh) -> None:
        super().__init__()
        self.config, self.mesh = config, mesh
        self.pooler = BertPooler(config, mesh)
        self.classifier = _small_head(config, mesh, config.num_labels)

    def forward(self, hidden: Tensor, labels: Tensor | None) -> Tensor:
        pooled = self.pooler(_gather_sequence(hidden, self.config, self.mesh))
        pooled = hidden_dropout(pooled, self.config.hidden_dropout, self.training, self.mesh, False)
        logits = self.classifier(pooled)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float(), labels, reduction="none")


class _BertBase(StagedModel):
    model_type = "bert"

    def build_embedding(self) -> nn.Module:
        return Embedding(self.config, self.mesh)

    def encode(self, x: Tensor, token_type_ids: Tensor | None, attention_mask: Tensor | None) -> Tensor:
        """Embedding (first stage) and this model's layers: [b, s] ids or [b, s(/tp), h] -> [b, s(/tp), h]."""
        if token_type_ids is not None and not self.pre_process:
            token_type_ids = None  # only the embedding reads them; later stages may be handed them anyway
        hidden = self.embedding(x, token_type_ids) if self.pre_process else x
        return self.run_layers(hidden, padding_mask(attention_mask))


class BertModel(_BertBase):
    """BERT for pretraining: ``embedding``, ``layers`` (post-LN, padding mask), ``head`` (MLM tied to the
    word embeddings; with ``add_binary_head`` the pooler and the NSP/SOP head, as BertForPreTraining).

    forward(input_ids [b, s], token_type_ids [b, s] | None, attention_mask [b, s] | None,
    labels [b, s] | None, return_binary_logits=False, next_sentence_label [b] | None) -> MLM logits
    [b, s, V] | per-token loss [b, s], or (that, binary logits [b, 2]); with labels and
    next_sentence_label (per-token MLM loss [b, s], per-sequence binary loss [b]), float32, 0 where
    a label is -100: one loss per label, in the order the engine divides them by their global
    counts (``tpzoo.engine.pipeline.LOSS_LABELS``). Stages: see ``StagedModel``.
    """

    ties_output_to_embedding = True

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh | None = None, *, add_binary_head: bool = True,
                 pre_process: bool = True, post_process: bool = True, layers: Iterable[int] | None = None) -> None:
        self.add_binary_head = add_binary_head
        super().__init__(config, mesh, pre_process=pre_process, post_process=post_process, layers=layers)

    def build_head(self) -> nn.Module:
        return BertHead(self.config, self.mesh, self.pre_process, self.add_binary_head)

    @classmethod
    def loss_names(cls, data: object) -> dict[str, str]:
        """``mlm_loss``, and the binary head's after the sentence task of ``data`` (``BertDataset.binary_head``):
        ``sop_loss`` (sentence order, the default) or ``nsp_loss`` (next sentence); none without one."""
        binary = getattr(data, "binary_head", "sop")
        return {"labels": "mlm_loss", **({"next_sentence_label": f"{binary}_loss"} if binary else {})}

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, return_binary_logits: bool = False,
                next_sentence_label: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        hidden = self.encode(input_ids, token_type_ids, attention_mask)
        if not self.post_process:
            return hidden
        tied = self.embedding.word_embeddings.weight if self.pre_process and self.config.tie_word_embeddings else None
        return self.head(hidden, labels, tied, return_binary_logits, next_sentence_label)


class BertForSequenceClassification(_BertBase):
    """BERT with a classification head for fine-tuning: ``head`` = pooler + dropout + classifier.

    forward(input_ids, token_type_ids=None, attention_mask=None, labels [b] | None) -> logits
    [b, config.num_labels] | per-example cross-entropy loss [b].
    """

    def build_head(self) -> nn.Module:
        return BertClassificationHead(self.config, self.mesh)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> Tensor:
        hidden = self.encode(input_ids, token_type_ids, attention_mask)
        if not self.post_process:
            return hidden
        return self.head(hidden, labels)
