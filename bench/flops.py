"""Model FLOPs per training token and the peak bf16 rate of the device: MFU's numerator and
denominator in bench/models.py (formula: ``flops_per_token``)."""

from __future__ import annotations

import torch
import transformers
from baselines import REFERENCES
from torch import nn

from tpzoo.convert.mapping import config_to_hf
from tpzoo.models import num_parameters
from tpzoo.models.config import ModelConfig
from tpzoo.training.metrics import active_parameters

# peak dense bf16 FLOP/s by device name, the first name found in torch.cuda.get_device_name() counts
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("B200", 2250e12),
             ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12))


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(N total, N in matrix multiplies) of the benchmarked model, counted on its Hugging Face model
    (built on the meta device): every parameter once, less the embedding tables that are only looked
    up (positions, token types, an input embedding not tied to the output layer)."""
    arch = REFERENCES[config.model_type].hf_architecture
    with torch.device("meta"):
        model = getattr(transformers, arch)(config_to_hf(config, arch))
    total = sum(p.numel() for p in model.parameters())
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup = sum(m.weight.numel() for m in model.modules()
                 if isinstance(m, nn.Embedding) and id(m.weight) not in linear)
    return total, total - lookup


def flops_per_token(config: ModelConfig, seq_length: int) -> int:
    """Model FLOPs of one training token (forward and backward), PaLM's and nanoGPT's convention:

        6 N + 12 L h s

    N: parameters in matrix multiplies (``parameter_counts``), 2 N FLOPs forward and 4 N backward;
    12 L h s: per layer, the scores Q K^T and the sum P V take 2 s h FLOPs per token each forward, x 3
    with backward; h = query heads x head size, so grouped-query attention (fewer kv heads) changes N
    only. Bidirectional (BERT) and causal attention both count the full s x s scores (causal attention
    needs about half; the convention counts it whole). A mixture of experts counts the experts a token
    goes through: N less the N - k experts of each layer its router leaves out
    (``tpzoo.training.metrics.active_parameters``)."""
    idle = num_parameters(config) - active_parameters(config)
    return 6 * (parameter_counts(config)[1] - idle) + 12 * config.num_layers * config.hidden_size * seq_length


def peak_flops() -> float | None:
    """The peak dense bf16 FLOP/s of the CUDA device (None: unknown, or no CUDA)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((peak for key, peak in PEAK_BF16 if key in name), None)
