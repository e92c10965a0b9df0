"""The model zoo: GPT, BERT and Llama, assembled from a block library of plain PyTorch modules (norms,
attention, MLP, transformer block, embeddings and heads; see docs/models.md and docs/new-model.md).
A model is ``embedding`` + ``layers`` + ``head`` so that a pipeline stage is just a part of one, and
runs on one device as it stands. How tensor parallelism splits it is its ``sharding`` plan, data next
to it (``tpzoo.sharding_plan``), which ``build_model`` applies with a ``tpzoo.parallel.ParallelPlan``
piece by piece; results do not depend on tp. The families are registered in
``tpzoo.models.families`` (``register_family`` takes one from outside the tree); their model and
config classes (``LlamaModel``, ``LlamaConfig``) are names of this package too.

Names load on first use, so the configs and presets (``tpzoo.models.config``, ``.presets``)
import without torch: the training scripts check their flags before loading it.
"""

from importlib.util import find_spec

from tpzoo.lazy import lazy_exports

_EXPORTS = {
    "attention": ("ATTENTION_PLAN", "Attention", "CoreAttention", "document_mask", "padding_mask"),
    "base": ("PipelineStage", "StagedModel", "building", "piece_seed"),
    "bert": ("BertForSequenceClassification", "BertModel"),
    "build": ("ParallelAttention", "build_model"),
    "causal_lm": ("CausalLM", "DECODER_PLAN"),
    "config": ("LlamaConfig", "ModelConfig", "TransformerConfig"),
    "embedding": ("EMBEDDING_PLAN", "Embedding"),
    "families": ("FAMILIES", "Family", "FamilySpec", "HFAdapter", "family", "register_family", "resolve_family"),
    "gpt": ("GPTModel",),
    "heads": ("ClassificationHead", "LM_HEAD_PLAN", "LMHead", "LMOutput", "MLMHead", "MLM_HEAD_PLAN", "Pooler"),
    "kv_cache": ("KVCache",),
    "mlp": ("MLP", "MLP_PLAN"),
    "moe": ("MOE_PLAN", "MoE"),
    "norms": ("norm",),
    "presets": ("PRESETS", "format_presets", "get_preset", "list_presets", "num_parameters"),
    "rope": ("RotaryEmbedding",),
    "sharding": ("full_grads", "full_state_dict", "load_full_state_dict"),
    "transformer": ("LAYER_PLAN", "TransformerLayer"),
}
_exported, __all__ = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str) -> object:
    """A block-library name, else a model or config class of any registered family (``LlamaModel``):
    a new family needs no line here."""
    try:
        return _exported(name)
    except AttributeError:
        if name.startswith("__") or find_spec(f"{__name__}.{name}") is not None:
            raise  # a submodule (``from tpzoo.models import rope``): Python imports it next
        from tpzoo.models.families import FAMILIES

        for f in FAMILIES.values():
            found = {**f.spec.models, f.config_class.__name__: f.config_class}
            if name in found:
                return found[name]
        raise
