"""Named model shapes (GPT-2 and BERT sizes, tiny ones for tests and the demo) and parameter counts.

    get_preset("gpt2")                      # TransformerConfig of GPT-2 small
    get_preset("bert-base", hidden_dropout=0.0)
    list_presets()                          # one row per preset, with its parameter count

Parameter counts are analytic (nothing is built) and count what the Hugging Face model of the
same config holds: the real vocabulary (not the padded one), a tied output layer once.
"""

from __future__ import annotations

from typing import Any

from tpzoo.models.config import TransformerConfig

_GPT2 = dict(model_type="gpt", vocab_size=50257, max_position_embeddings=1024, layernorm_epsilon=1e-5,
             layernorm_position="pre", activation="gelu_tanh", type_vocab_size=0)
_BERT = dict(model_type="bert", vocab_size=30522, max_position_embeddings=512, layernorm_epsilon=1e-12,
             layernorm_position="post", activation="gelu", type_vocab_size=2)
# The tiny presets use the 512-token vocabulary of the bundled demo tokenizer.
_TINY = dict(vocab_size=512, max_position_embeddings=256, hidden_dropout=0.1, attention_dropout=0.1)

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(_GPT2, num_layers=12, hidden_size=768, num_attention_heads=12),
    "gpt2-medium": dict(_GPT2, num_layers=24, hidden_size=1024, num_attention_heads=16),
    "gpt2-large": dict(_GPT2, num_layers=36, hidden_size=1280, num_attention_heads=20),
    "gpt2-xl": dict(_GPT2, num_layers=48, hidden_size=1600, num_attention_heads=25),
    "gpt-tiny": dict(_GPT2, **_TINY, num_layers=4, hidden_size=128, num_attention_heads=4),
    "bert-base": dict(_BERT, num_layers=12, hidden_size=768, num_attention_heads=12),
    "bert-large": dict(_BERT, num_layers=24, hidden_size=1024, num_attention_heads=16),
    "bert-tiny": dict(_BERT, **_TINY, num_layers=2, hidden_size=128, num_attention_heads=4),
}


def get_preset(name: str, **overrides: Any) -> TransformerConfig:
    """The config of preset ``name`` with ``overrides`` applied (field names of TransformerConfig)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return TransformerConfig(**PRESETS[name]).replace(**overrides)


def _layer_parameters(c: TransformerConfig) -> int:
    h, f = c.hidden_size, c.ffn_size
    attention = h * 3 * h + 3 * h + h * h + h
    mlp = h * f + f + f * h + h
    return attention + mlp + 2 * 2 * h  # two LayerNorms


def num_parameters(config: TransformerConfig, head: str | None = None) -> int:
    """Parameters of the model, counted like Hugging Face (real vocabulary, tied weights once).

    head: "lm" (GPTModel = GPT2LMHeadModel), "pretraining" (BertModel with its next-sentence
    head = BertForPreTraining), "mlm" (BertModel(add_binary_head=False) = BertForMaskedLM) or
    "classification" (BertForSequenceClassification). Default: lm for gpt, pretraining for bert.
    """
    c = config
    head = head or ("lm" if c.model_type == "gpt" else "pretraining")
    heads = ("lm",) if c.model_type == "gpt" else ("pretraining", "mlm", "classification")
    if head not in heads:
        raise ValueError(f"head {head!r} does not apply to a {c.model_type} config; choose one of {heads}")
    h, v = c.hidden_size, c.vocab_size
    n = v * h + c.max_position_embeddings * h + c.type_vocab_size * h + c.num_layers * _layer_parameters(c)
    n += 2 * h  # the embedding LayerNorm (post-LN) or the final LayerNorm (pre-LN)
    if head in ("lm", "pretraining", "mlm") and not c.tie_word_embeddings:
        n += v * h
    if head in ("pretraining", "mlm"):
        n += h * h + h + 2 * h + v  # MLM transform dense, its LayerNorm, the output bias
    if head in ("pretraining", "classification"):
        n += h * h + h  # pooler
    if head == "pretraining":
        n += 2 * h + 2  # next-sentence / sentence-order head
    if head == "classification":
        n += h * c.num_labels + c.num_labels
    return n


def list_presets() -> list[dict[str, Any]]:
    """One dict per preset: name, model, layers, hidden, heads, ffn, vocab, positions, parameters."""
    rows = []
    for name in PRESETS:
        c = get_preset(name)
        rows.append(dict(name=name, model=c.model_type, layers=c.num_layers, hidden=c.hidden_size,
                         heads=c.num_attention_heads, ffn=c.ffn_size, vocab=c.vocab_size,
                         positions=c.max_position_embeddings, parameters=num_parameters(c)))
    return rows


def format_presets() -> str:
    """``list_presets()`` as an aligned text table."""
    rows = list_presets()
    cols = list(rows[0])
    cells = [[f"{r[k]:,}" if k == "parameters" else str(r[k]) for k in cols] for r in rows]
    widths = [max(len(k), *(len(row[i]) for row in cells)) for i, k in enumerate(cols)]
    lines = [[k for k in cols], *cells]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in lines)
