"""TransformerConfig validation and dict round trip; presets and their parameter counts against Hugging Face."""

from __future__ import annotations

import json
import re

import pytest
import torch
from families import CASES, CAUSAL_LM, CAUSAL_LM_SMALL, CAUSAL_LM_XL, MASKED_LM, MASKED_LM_BASE, PUBLISHED

from tpzoo.models import PRESETS, TransformerConfig, family, format_presets, get_preset, list_presets, num_parameters

pytestmark = pytest.mark.tier("unit")




@pytest.mark.parametrize("changes, message", [
    (dict(num_layers=0), "TransformerConfig.num_layers must be >= 1, got 0"),
    (dict(hidden_size=64.0), "TransformerConfig.hidden_size must be an int, got float 64.0"),
    (dict(num_attention_heads=True), "TransformerConfig.num_attention_heads must be an int, got bool True"),
    (dict(ffn_hidden_size=-4), "TransformerConfig.ffn_hidden_size must be >= 1, got -4"),
    (dict(hidden_dropout=1.0), r"TransformerConfig.hidden_dropout must lie in \[0, 1\), got 1.0"),
    (dict(attention_dropout=-0.1), r"TransformerConfig.attention_dropout must lie in \[0, 1\), got -0.1"),
    (dict(layernorm_epsilon=0.0), "TransformerConfig.layernorm_epsilon must be > 0, got 0.0"),
    (dict(layernorm_position="middle"), "TransformerConfig.layernorm_position must be one of 'pre', 'post', "
                                        "got 'middle'"),
    (dict(activation="relu"), "TransformerConfig.activation must be one of 'gelu', 'gelu_tanh', got 'relu'"),
    (dict(tie_word_embeddings=1), "TransformerConfig.tie_word_embeddings must be True or False, got int 1"),
    (dict(num_labels=1), "TransformerConfig.num_labels must be >= 2, got 1"),
    (dict(hidden_size=100, num_attention_heads=12), "hidden_size=100 is not divisible by num_attention_heads=12"),
    (dict(model_type=MASKED_LM.family, type_vocab_size=0),
     rf"a {MASKED_LM.family} config needs type_vocab_size >= 1 \(segments A/B\), got 0"),
])
def test_config_rejects_bad_values_naming_them(changes, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**changes)


def test_config_round_trips_through_a_plain_dict():
    config = get_preset(MASKED_LM_BASE, hidden_dropout=0.0)
    data = json.loads(json.dumps(config.to_dict()))
    assert TransformerConfig.from_dict(data) == config
    assert config.ffn_size == 3072 and config.head_dim == 64 and not MASKED_LM.model_class.causal
    # the older layout, which held the run options (now the ParallelPlan's), still reads
    assert TransformerConfig.from_dict({**data, "sequence_parallel": True, "kernels": "torch", "seed": 3}) == config
    with pytest.raises(ValueError, match=r"unknown TransformerConfig field\(s\) \['hidden'\]"):
        TransformerConfig.from_dict({**data, "hidden": 3})
    with pytest.raises(ValueError, match=r"unknown TransformerConfig field\(s\) \['layers'\]"):
        config.replace(layers=3)
    with pytest.raises(ValueError, match="TransformerConfig.num_layers must be >= 1, got 0"):
        config.replace(num_layers=0)
    # ffn_hidden_size=None follows hidden_size when a preset is overridden (4 h)
    assert get_preset(CAUSAL_LM_SMALL, hidden_size=256, num_attention_heads=4).ffn_size == 1024


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match=re.escape(f"unknown preset 'gpt3'; choose one of {', '.join(PRESETS)}")):
        get_preset("gpt3")
    with pytest.raises(ValueError, match=f"head 'lm' does not apply to a {MASKED_LM.family} config"):
        num_parameters(get_preset(MASKED_LM_BASE), "lm")


def hf_counts(name: str) -> dict[str, int]:
    """Parameters of the Hugging Face models of preset ``name`` (every architecture its family converts to,
    configs from the family's adapter), built on the meta device (no memory)."""
    import transformers

    from tpzoo.models.hf_rules import is_classifier

    c = get_preset(name)
    adapter = family(c.model_type).spec.hf
    heads = {case.architecture: case.head for case in CASES.values()}  # num_parameters' head of each
    heads.update({arch: "classification" for arch in adapter.architectures if is_classifier(arch)})
    with torch.device("meta"):
        models = {arch: getattr(transformers, arch)(adapter.config_to_hf(c, arch)) for arch in adapter.architectures}
    return {heads[arch]: sum(p.numel() for p in model.parameters()) for arch, model in models.items()}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_counts_equal_hugging_face(name):
    config = get_preset(name)
    for head, count in hf_counts(name).items():
        assert num_parameters(config, head) == count, f"{name} {head}"
    if name in PUBLISHED:
        assert num_parameters(config) == PUBLISHED[name]


def test_list_presets_shows_every_preset_with_its_parameters():
    rows = list_presets()
    assert [r["name"] for r in rows] == list(PRESETS)
    assert {r["name"]: r["parameters"] for r in rows}[CAUSAL_LM_SMALL] == 124_439_808
    table = format_presets().splitlines()
    assert table[0].split() == list(rows[0])
    assert table[4].split() == [CAUSAL_LM_XL, CAUSAL_LM.family, "48", "1600", "25", "6400", "50257", "1024",
                                "1,557,611,200"]
