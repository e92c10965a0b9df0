"""Named model shapes of every family (``tpzoo.models.families``) and parameter counts.

    get_preset("gpt2")                      # the config of GPT-2 small
    get_preset("bert-base", hidden_dropout=0.0)
    list_presets()                          # one row per preset, with its parameter count

Parameter counts are analytic (nothing is built) and count what the Hugging Face model of the
same config holds: the real vocabulary (not the padded one), a tied output layer once.
"""

from __future__ import annotations

from typing import Any

from tpzoo.models.config import ModelConfig
from tpzoo.models.families import FAMILIES, PRESETS, family


def preset_family(name: str) -> str:
    """The family a preset belongs to."""
    for f in FAMILIES.values():
        if name in f.presets:
            return f.name
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The config of preset ``name`` (its family's config class) with ``overrides`` applied."""
    config_class = family(preset_family(name)).config_class
    return config_class(**PRESETS[name]).replace(**overrides)


def layer_parameters(hidden: int, ffn: int, heads: int, groups: int, *, bias: bool, gated: bool,
                     norm_params: int, head_dim: int | None = None) -> int:
    """One transformer layer: fused QKV [(n + 2g) d, h], output [h, n d], MLP h -> f (x2 gated) -> h,
    two norms of ``norm_params`` each; biases on every linear when ``bias``; d = ``head_dim`` or h / n."""
    d = head_dim or hidden // heads
    qkv, f_in = (heads + 2 * groups) * d, ffn * (2 if gated else 1)
    weights = hidden * qkv + heads * d * hidden + hidden * f_in + ffn * hidden
    return weights + (qkv + hidden + f_in + hidden if bias else 0) + 2 * norm_params


def num_parameters(config: ModelConfig, head: str | None = None) -> int:
    """Parameters of the model, counted like Hugging Face (real vocabulary, tied weights once); ``head``:
    see the family's count (GPT: lm; BERT: pretraining, mlm, classification), None: the default."""
    return family(config.model_type).spec.num_parameters(config, head)


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
