"""LoRA adapters of a tpzoo model as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
that ``peft.PeftModel.from_pretrained(hf_model, folder)`` opens on the Hugging Face base model.

A tpzoo adapter sits on one tpzoo weight W [out, in]: A [r, in], B [out, r], W + s B A. Hugging Face may hold W
as several modules (Llama's q, k, v and gate, up projections) whose rows are W's rows reordered: the weight's
conversion rule (``tpzoo.models.hf_rules.Rule``) moves rows only, so applied to B it gives each module's B, and
every module keeps A whole: B_k A is exactly the rows of B A that module holds. GPT-2's Conv1D modules store W
transposed; PEFT still keeps their factors as Linear weights ([r, in] and [out, r]) with ``fan_in_fan_out``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from tpzoo.convert.mapping import architecture_of, rules_for
from tpzoo.lora_options import LoRAConfig
from tpzoo.models.config import ModelConfig
from tpzoo.models.hf_rules import is_classifier
from tpzoo.parallel.lora import ADAPTER

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_adapters(class_name: str, options: dict[str, Any], config: ModelConfig, state: dict[str, Tensor]
                  ) -> tuple[dict[str, Tensor], list[str], bool]:
    """(PEFT's tensors ``base_model.model.{module}.lora_A/B.weight``, the adapted Hugging Face modules, whether
    they are Conv1D: ``fan_in_fan_out``) of the adapters in the full state dict ``state``."""
    rules = {r.tpzoo: r for r in rules_for(config, architecture_of(class_name, options))}
    tensors: dict[str, Tensor] = {}
    transposed = set()
    for key in sorted(k for k in state if k.endswith(f".{ADAPTER}.lora_A")):
        layer = key.removesuffix(f".{ADAPTER}.lora_A")
        rule = rules[f"{layer}.weight"]
        pieces = rule.to_hf(state[f"{layer}.{ADAPTER}.lora_B"])
        transposed.add(rule.transposed)
        for name, b in zip(rule.hf, pieces):
            module = f"base_model.model.{name.removesuffix('.weight')}"
            tensors[f"{module}.lora_A.weight"] = state[key].clone()
            tensors[f"{module}.lora_B.weight"] = (b.t() if rule.transposed else b).contiguous()
    if len(transposed) > 1:
        raise ValueError("adapters on both Conv1D and Linear modules do not fit one PEFT config (fan_in_fan_out)")
    modules = sorted(k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                     for k in tensors if k.endswith(".lora_A.weight"))
    return tensors, modules, transposed == {True}


def write_peft(folder: str | Path, base: str | Path, class_name: str, options: dict[str, Any], config: ModelConfig,
               state: dict[str, Tensor], lora: LoRAConfig) -> Path:
    """Write the adapters of ``state`` (a LoRA model's full state dict, ``lora`` its config) as a PEFT folder whose
    base model is the Hugging Face folder ``base``."""
    tensors, modules, fan_in_fan_out = peft_adapters(class_name, options, config, state)
    if not tensors:
        raise ValueError("the model holds no LoRA adapters to write as a PEFT folder")
    arch = architecture_of(class_name, options)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA", "task_type": "SEQ_CLS" if is_classifier(arch) else "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base).resolve()), "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "target_modules": modules, "fan_in_fan_out": fan_in_fan_out, "bias": "none",
        "inference_mode": True,
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    return folder
