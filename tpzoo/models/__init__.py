"""The model zoo: GPT and BERT built from tensor-parallel layers (see docs/models.md).

Every matrix multiply is tensor-parallel, results do not depend on tp, and a model is
``embedding`` + ``layers`` + ``head`` so that a pipeline stage is just a part of one.

Names load on first use, so the configs and presets (``tpzoo.models.config``, ``.presets``)
import without torch: the training scripts check their flags before loading it.
"""

from tpzoo.lazy import lazy_exports

_EXPORTS = {
    "attention": ("ParallelAttention",),
    "base": ("StagedModel", "piece_seed"),
    "bert": ("BertForSequenceClassification", "BertModel"),
    "config": ("TransformerConfig",),
    "gpt": ("GPTModel",),
    "kv_cache": ("KVCache",),
    "mlp": ("ParallelMLP",),
    "presets": ("PRESETS", "format_presets", "get_preset", "list_presets", "num_parameters"),
    "sharding": ("full_grads", "full_state_dict", "load_full_state_dict"),
    "transformer": ("LayerNorm", "TransformerLayer"),
}
__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
