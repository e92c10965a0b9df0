"""The model zoo: GPT and BERT built from tensor-parallel layers (see docs/models.md).

Every matrix multiply is tensor-parallel, results do not depend on tp, and a model is
``embedding`` + ``layers`` + ``head`` so that a pipeline stage is just a part of one.
"""

from tpzoo.models.attention import ParallelAttention
from tpzoo.models.base import StagedModel, piece_seed
from tpzoo.models.bert import BertForSequenceClassification, BertModel
from tpzoo.models.config import TransformerConfig
from tpzoo.models.gpt import GPTModel
from tpzoo.models.kv_cache import KVCache
from tpzoo.models.mlp import ParallelMLP
from tpzoo.models.presets import PRESETS, format_presets, get_preset, list_presets, num_parameters
from tpzoo.models.sharding import full_grads, full_state_dict, load_full_state_dict
from tpzoo.models.transformer import LayerNorm, TransformerLayer

__all__ = [
    "PRESETS", "BertForSequenceClassification", "BertModel", "GPTModel", "KVCache", "LayerNorm", "ParallelAttention",
    "ParallelMLP", "StagedModel", "TransformerConfig", "TransformerLayer", "format_presets", "full_grads",
    "full_state_dict", "get_preset", "list_presets", "load_full_state_dict", "num_parameters", "piece_seed",
]
