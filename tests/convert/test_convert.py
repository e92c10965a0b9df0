"""Hugging Face <-> tpzoo conversion without a process group: exact round trips, layouts, misuse, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from hf_models import hf_bert, hf_gpt2

from tpzoo.convert import ConversionError, hf_to_tpzoo, read_hf, tpzoo_to_hf
from tpzoo.models.hf_rules import heads_from_qkv, qkv_from_heads

ROOT = Path(__file__).resolve().parents[2]
D = 32 // 4  # head dim of the tiny models


def hf_models() -> dict[str, torch.nn.Module]:
    return {
        "GPT2LMHeadModel": hf_gpt2(), "GPT2LMHeadModel untied": hf_gpt2(tie=False),
        "BertForPreTraining": hf_bert(transformers.BertForPreTraining),
        "BertForMaskedLM": hf_bert(transformers.BertForMaskedLM),
        "BertForSequenceClassification": hf_bert(transformers.BertForSequenceClassification),
    }


def test_state_dicts_round_trip_exactly_with_heads_laid_out_per_head():
    for name, hf in hf_models().items():
        original = hf.state_dict()
        class_name, options, config, state = hf_to_tpzoo(hf.config, original, type(hf).__name__)
        assert config.tie_word_embeddings == ("untied" not in name), name
        qkv = state["layers.1.self_attention.query_key_value.weight"]
        if name.startswith("Bert"):
            q, k, v = (original[f"bert.encoder.layer.1.attention.self.{p}.weight"] for p in ("query", "key", "value"))
        else:
            q, k, v = original["transformer.h.1.attn.c_attn.weight"].t().chunk(3)
        for head in range(4):  # [q_h k_h v_h] blocks of D rows, head after head
            block = qkv[3 * D * head: 3 * D * (head + 1)]
            rows = slice(D * head, D * (head + 1))
            assert torch.equal(block, torch.cat([q[rows], k[rows], v[rows]])), f"{name} head {head}"
        _, back, tied = tpzoo_to_hf(class_name, options, config, state)
        assert back.keys() == original.keys(), f"{name}: {sorted(set(back) ^ set(original))}"
        for key in original:
            assert torch.equal(back[key], original[key]), f"{name}: {key} changed"
        assert tied == ({"lm_head.weight"} if name == "GPT2LMHeadModel" else
                        {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
                        if name in ("BertForPreTraining", "BertForMaskedLM") else set()), name
    w = torch.randn(3 * 32, 5)
    assert torch.equal(heads_from_qkv(*qkv_from_heads(w, 4), heads=4), w)


def test_what_tpzoo_cannot_represent_is_refused():
    hf = hf_gpt2()
    with pytest.raises(ConversionError, match="unsupported Hugging Face config: scale_attn_by_inverse_layer_idx"):
        hf.config.scale_attn_by_inverse_layer_idx = True
        hf_to_tpzoo(hf.config, hf.state_dict(), "GPT2LMHeadModel")
    hf = hf_bert(transformers.BertForMaskedLM)
    hf.config.architectures = ["BertForMaskedLM"]
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
    hf.config.architectures = ["BertForQuestionAnswering"]
    with pytest.raises(ConversionError, match=r"names architectures \['BertForQuestionAnswering'\]"):
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


def test_command_line_round_trip_and_misuse(tmp_path):
    hf = hf_bert(transformers.BertForSequenceClassification)
    hf.save_pretrained(tmp_path / "hf")
    done = convert("from-hf", "hf", "tz", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "wrote tpzoo BertForSequenceClassification" in done.stdout
    done = convert("to-hf", "tz", "hf2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    back = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "hf2").state_dict()
    assert back.keys() == hf.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    assert read_hf(tmp_path / "hf2")[0].num_labels == 3

    assert convert("--help", cwd=tmp_path).returncode == 0
    assert_misuse(convert("to-hf", "tz", "hf2", cwd=tmp_path),
                  "hf2 already exists and is not empty; choose a new folder or pass --overwrite")
    assert convert("to-hf", "tz", "hf2", "--overwrite", cwd=tmp_path).returncode == 0
    assert_misuse(convert("from-hf", "tz", "out", cwd=tmp_path),
                  "tz is a tpzoo model folder, not a Hugging Face one; convert it with to-hf")
    assert not (tmp_path / "out").exists()  # the other misuses: tests/misuse_cases.py, in one process
