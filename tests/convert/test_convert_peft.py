"""LoRA adapters as a PEFT folder (tpzoo.convert.peft_adapters), on state dicts in one process: for GPT-2 (Conv1D,
fused c_attn), Llama (q, k, v and gate, up split from tpzoo's fused weights) and Qwen2, random adapters on every
linear layer of each transformer layer, written as a PEFT folder over the base model's Hugging Face weights, give
``peft.PeftModel``'s logits equal (1e-5) to those of the Hugging Face model of the merged weights (``merge_adapters``:
W + s B A), whose logits equal tpzoo's (test_convert*, test_checkpoint_lora). The command line's --peft:
tests/checkpoint/test_checkpoint_lora.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from families import CAUSAL_LM, GQA_LM, QKV_BIAS_LM, hf_class, hf_model

from tpzoo.convert import hf_to_tpzoo, tpzoo_to_hf
from tpzoo.convert.peft_adapters import ADAPTER_CONFIG, write_peft
from tpzoo.convert.hf import write_hf
from tpzoo.lora_options import LAYER_LINEARS, LoRAConfig
from tpzoo.parallel.lora import ADAPTER, merge_adapters

pytestmark = pytest.mark.tier("unit")

LORA = LoRAConfig(rank=4, alpha=8.0, targets=",".join(LAYER_LINEARS))
CASES = {"gpt": CAUSAL_LM, "llama": GQA_LM, "qwen2": QKV_BIAS_LM}


def with_adapters(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """``state`` with random factors A [r, in], B [out, r] on every adapted linear layer's weight."""
    g = torch.Generator().manual_seed(0)
    out = dict(state)
    for key, w in state.items():
        layer = key.removesuffix(".weight")
        if ".layers." in f".{key}" and key.endswith(".weight") and layer.rsplit(".", 1)[-1] in LAYER_LINEARS:
            out[f"{layer}.{ADAPTER}.lora_A"] = torch.randn(rank, w.shape[1], generator=g) * 0.1
            out[f"{layer}.{ADAPTER}.lora_B"] = torch.randn(w.shape[0], rank, generator=g) * 0.1
    return out


@pytest.mark.parametrize("name", CASES)
def test_peft_folder_gives_the_merged_model_logits(name, tmp_path):
    import peft

    case = CASES[name]
    hf = hf_model(case).eval()
    class_name, options, config, state = hf_to_tpzoo(hf.config, hf.state_dict(), case.architecture)
    adapted = with_adapters(state, LORA.rank)
    write_hf(tmp_path / "base", *tpzoo_to_hf(class_name, options, config, state))
    write_peft(tmp_path / "adapter", tmp_path / "base", class_name, options, config, adapted, LORA)
    write_hf(tmp_path / "merged", *tpzoo_to_hf(class_name, options, config, merge_adapters(adapted, LORA)))

    saved = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert saved["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert saved["fan_in_fan_out"] == (name == "gpt") and len(saved["target_modules"]) == (
        4 if name == "gpt" else 7) * config.num_layers
    base = hf_class(case).from_pretrained(tmp_path / "base").eval()
    with_peft = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = hf_class(case).from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, config.vocab_size if name != "gpt" else hf.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got, plain = merged(ids).logits, with_peft(ids).logits, hf(ids).logits
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-5, f"PEFT's logits differ from the merged model's by {err:.2e}"
    assert (plain - expected).abs().max() > 1e-2, "the adapters change nothing: the test would not see a wrong B"
