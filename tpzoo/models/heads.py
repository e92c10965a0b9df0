"""The heads: what reads the vocabulary (or a class) back out of the last hidden states. Plain PyTorch.

    LMOutput    logits = H E^T (+ b) against an output weight E [V, h]; with labels the per-token loss
    LMHead      a decoder's: final norm, then ``LMOutput`` (``LM_HEAD_PLAN``)
    MLMHead     BERT's masked-LM head: dense + GELU + LayerNorm, then ``LMOutput`` with a vocabulary bias
    Pooler      tanh(dense(hidden[:, 0])): the first token's summary
    ClassificationHead   pooler, dropout, classifier: [b, s, h] -> [b, classes] | the loss [b]
    LastTokenHead        a decoder's classifier: final norm, ``score`` at the last real token -> [b, classes]

The output weight E is the word embedding's (tied, passed in by the model) or ``output_layer`` /
``word_embeddings`` of the head itself (``output_weight``; ``tpzoo.models.base`` adds them). Their plans
split E and b over tp by vocabulary rows and compute logits and cross entropy per slice
(``vocab_output``), never gathering the vocabulary for a loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo.models.weights import linear

# the output weight a head holds (untied, or a last stage's copy of the word embedding) is split as the vocabulary
OUTPUT_WEIGHT_PLAN = {"output_layer": "vocab", "word_embeddings": "vocab"}
LM_HEAD_PLAN = {"final_layernorm": "norm", "output": "vocab_output", **OUTPUT_WEIGHT_PLAN}
MLM_HEAD_PLAN = {"layernorm": "norm", "output_bias": "vocab", "output": "vocab_output"}


def output_weight(head: nn.Module, embedding_weight: Tensor | None) -> Tensor:
    """The head's output weight E [V, h]: its ``output_layer``'s (untied), else ``embedding_weight`` (tied, the
    model holds the embedding), else its ``word_embeddings``' (tied, a last pipeline stage's copy)."""
    if hasattr(head, "output_layer"):
        return head.output_layer.weight
    return embedding_weight if embedding_weight is not None else head.word_embeddings.weight


class LMOutput(nn.Module):
    """hidden [b, s, h], weight E [V, h] (, bias [V]) -> per-token cross entropy [b, s] (float32, 0 where
    labels == -100) given labels [b, s], else the logits [b, s, V]."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor | None = None,
                bias: Tensor | None = None) -> Tensor:
        logits = F.linear(hidden, weight, bias)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view(labels.shape)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}"


class LMHead(nn.Module):
    """A decoder's head: ``final_layernorm`` (any norm), then ``LMOutput`` against the output weight.
    forward(hidden, labels, embedding_weight) -> per-token loss [b, s] | logits [b, s, V]."""

    def __init__(self, norm: nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.final_layernorm = norm
        self.output = LMOutput(vocab_size)

    def forward(self, hidden: Tensor, labels: Tensor | None, embedding_weight: Tensor | None = None) -> Tensor:
        return self.output(self.final_layernorm(hidden), output_weight(self, embedding_weight), labels)


class VocabBias(nn.Module):
    """An output bias over the vocabulary, ``bias`` [V], zero at init."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size))


class MLMHead(nn.Module):
    """BERT's masked-LM head: dense [h, h] + GELU (``approximate``) + ``layernorm``, then logits against the
    output weight plus ``output_bias``. forward(hidden, weight, labels) -> loss [b, s] | logits [b, s, V]."""

    def __init__(self, hidden_size: int, vocab_size: int, layernorm: nn.Module, *, approximate: str = "none",
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.dense = linear(hidden_size, hidden_size, True, init_std)
        self.activation = nn.GELU(approximate=approximate)
        self.layernorm = layernorm
        self.output_bias = VocabBias(vocab_size)
        self.output = LMOutput(vocab_size)

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor | None) -> Tensor:
        y = self.layernorm(self.activation(self.dense(hidden)))
        return self.output(y, weight, labels, self.output_bias.bias)


class Pooler(nn.Module):
    """tanh(dense(hidden[:, 0])): [b, s, h] -> [b, h]."""

    def __init__(self, hidden_size: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.dense = linear(hidden_size, hidden_size, True, init_std)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class ClassificationHead(nn.Module):
    """``pooler``, dropout, ``classifier`` [classes, h]: hidden [b, s, h] -> logits [b, classes], or with labels
    [b] the per-example cross entropy [b] (float32)."""

    def __init__(self, hidden_size: int, num_labels: int, *, dropout: float = 0.0, init_std: float = 0.02) -> None:
        super().__init__()
        self.pooler = Pooler(hidden_size, init_std)
        self.dropout = nn.Dropout(dropout)
        self.classifier = linear(hidden_size, num_labels, True, init_std)

    def forward(self, hidden: Tensor, labels: Tensor | None) -> Tensor:
        logits = self.classifier(self.dropout(self.pooler(hidden)))
        return logits if labels is None else F.cross_entropy(logits.float(), labels, reduction="none")


def last_tokens(hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """hidden [b, s, h] at each sequence's last real token -> [b, h]: the rightmost position whose
    attention_mask [b, s] is 1 (padding may sit anywhere after it), the last position without a mask."""
    if attention_mask is None:
        return hidden[:, -1]
    if attention_mask.shape != hidden.shape[:2]:
        raise ValueError(f"attention_mask must be [b, s] = {list(hidden.shape[:2])}, got {list(attention_mask.shape)}")
    positions = torch.arange(hidden.shape[1], device=hidden.device)
    last = (positions * (attention_mask != 0)).argmax(-1)  # a row of padding alone reads position 0
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


class LastTokenHead(nn.Module):
    """A decoder as a sequence classifier, as Hugging Face's ``...ForSequenceClassification``: ``final_layernorm``
    (any norm), then ``score`` [classes, h] (no bias) at each sequence's last real token (``last_tokens``): under
    causal attention only that token has read the whole text. forward(hidden [b, s, h], labels [b] | None,
    attention_mask [b, s] | None) -> logits [b, classes] | the per-example cross entropy [b] (float32)."""

    def __init__(self, norm: nn.Module, hidden_size: int, num_labels: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.final_layernorm = norm
        self.score = linear(hidden_size, num_labels, False, init_std)

    def forward(self, hidden: Tensor, labels: Tensor | None, attention_mask: Tensor | None = None) -> Tensor:
        logits = self.score(self.final_layernorm(last_tokens(hidden, attention_mask)))
        return logits if labels is None else F.cross_entropy(logits.float(), labels, reduction="none")
