"""Hugging Face <-> tpzoo conversion without a process group: exact round trips, layouts, misuse, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from families import (CAUSAL_LM, CAUSAL_LM_UNTIED, CLASSIFIER, MASKED_LM, MASKED_LM_ONLY, OTHER_HEAD, hf_class,
                      hf_model)

from tpzoo.convert import ConversionError, hf_to_tpzoo, read_hf, tpzoo_to_hf
from tpzoo.models.hf_rules import heads_from_qkv, qkv_from_heads

pytestmark = pytest.mark.tier("unit")



ROOT = Path(__file__).resolve().parents[2]
D = 32 // 4  # head dim of the tiny models
# the cases converted here (test_convert_llama converts the grouped-query ones)
CONVERTED = (CAUSAL_LM, CAUSAL_LM_UNTIED, MASKED_LM, MASKED_LM_ONLY, CLASSIFIER)
# the tensors Hugging Face ties to the embedding (tpzoo_to_hf's third output) when the output layer is tied
TIED = {"causal-lm": {"lm_head.weight"}, "classification": set(),
        "masked-lm": {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}}
FUSED_QKV = "transformer.h.1.attn.c_attn.weight"  # layer 1's query, key and value in one Conv1D weight, if fused


def test_state_dicts_round_trip_exactly_with_heads_laid_out_per_head():
    for case in CONVERTED:
        hf, name = hf_model(case), case.name
        original = hf.state_dict()
        class_name, options, config, state = hf_to_tpzoo(hf.config, original, case.architecture)
        assert (class_name, options) == (case.model, case.options), name
        assert config.tie_word_embeddings == case.hf["tie_word_embeddings"], name
        qkv = state["layers.1.self_attention.query_key_value.weight"]
        if FUSED_QKV in original:
            q, k, v = original[FUSED_QKV].t().chunk(3)
        else:
            q, k, v = (original[f"bert.encoder.layer.1.attention.self.{p}.weight"] for p in ("query", "key", "value"))
        for head in range(4):  # [q_h k_h v_h] blocks of D rows, head after head
            block = qkv[3 * D * head: 3 * D * (head + 1)]
            rows = slice(D * head, D * (head + 1))
            assert torch.equal(block, torch.cat([q[rows], k[rows], v[rows]])), f"{name} head {head}"
        _, back, tied = tpzoo_to_hf(class_name, options, config, state)
        assert back.keys() == original.keys(), f"{name}: {sorted(set(back) ^ set(original))}"
        for key in original:
            assert torch.equal(back[key], original[key]), f"{name}: {key} changed"
        assert tied == (TIED[case.inputs] if case.hf["tie_word_embeddings"] else set()), name
    w = torch.randn(3 * 32, 5)
    assert torch.equal(heads_from_qkv(*qkv_from_heads(w, 4), heads=4), w)


def test_what_tpzoo_cannot_represent_is_refused():
    hf = hf_model(CAUSAL_LM)
    with pytest.raises(ConversionError, match="unsupported Hugging Face config: scale_attn_by_inverse_layer_idx"):
        hf.config.scale_attn_by_inverse_layer_idx = True
        hf_to_tpzoo(hf.config, hf.state_dict(), CAUSAL_LM.architecture)
    hf = hf_model(MASKED_LM_ONLY)
    hf.config.architectures = [MASKED_LM_ONLY.architecture]
    hf.config.hidden_act = "relu"
    with pytest.raises(ConversionError, match="activation 'relu' has no tpzoo equivalent"):
        hf_to_tpzoo(hf.config, hf.state_dict())
    hf.config.hidden_act = "gelu"
    hf.config.tie_word_embeddings = False
    with pytest.raises(ConversionError, match="tie_word_embeddings=False in a BERT with an MLM head"):
        hf_to_tpzoo(hf.config, hf.state_dict())
    hf.config.tie_word_embeddings = True
    state = hf.state_dict()
    with pytest.raises(ConversionError, match=r"has tensors tpzoo has no place for: \['extra.weight'\]"):
        hf_to_tpzoo(hf.config, {**state, "extra.weight": torch.zeros(1)})
    del state["bert.encoder.layer.1.output.dense.bias"]
    with pytest.raises(ConversionError, match=r"lacks \['bert.encoder.layer.1.output.dense.bias'\]"):
        hf_to_tpzoo(hf.config, state)
    hf.config.architectures = [OTHER_HEAD]
    with pytest.raises(ConversionError, match=rf"names architectures \['{OTHER_HEAD}'\]"):
        hf_to_tpzoo(hf.config, hf.state_dict())


def convert(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tpzoo.convert", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def assert_misuse(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in lines[0], lines[0]


@pytest.mark.tier("journey")
def test_command_line_round_trip_and_misuse(tmp_path):
    hf = hf_model(CLASSIFIER)
    hf.save_pretrained(tmp_path / "hf")
    done = convert("from-hf", "hf", "tz", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"wrote tpzoo {CLASSIFIER.model}" in done.stdout
    done = convert("to-hf", "tz", "hf2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    back = hf_class(CLASSIFIER).from_pretrained(tmp_path / "hf2").state_dict()
    assert back.keys() == hf.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    assert read_hf(tmp_path / "hf2")[0].num_labels == 3

    assert_misuse(convert("to-hf", "tz", "hf2", cwd=tmp_path),
                  "hf2 already exists and is not empty; choose a new folder or pass --overwrite")
    # --overwrite and --help: test_convert_decoders.py; the other misuses in one process: tests/misuse_cases_tools.py
