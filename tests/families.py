"""The model cases of the tests, and the roles they play: the only place the tests name a model family, a
preset, a tpzoo model class or a Hugging Face architecture. Every other test file takes what it needs
from here and builds its command lines and expected messages from these values.

A ``Case`` is a preset, the model class to build from it, constructor options and config changes;
``inputs`` says what a batch for it holds ("causal-lm": ids and next-token labels; "packed-lm": those and
the example of each token, ``document_ids``; "masked-lm": ids,
token types, padding mask, MLM labels and the sentence-order label; "classification": ids, token types
(for a model that reads them: BERT, not a decoder), padding mask and one label per sequence). ``batch`` and ``without_labels`` turn those into the keyword
arguments of any case, so a test loops over ``CASES`` without knowing a family. A case also knows its
family (``--model``), its model class, its Hugging Face architecture (the family's adapter says which)
and the config of its tiny random Hugging Face model (``hf``; built by ``hf_model``).

A test that needs one kind of model takes a role (``CAUSAL_LM``, ``GQA_LM``, ``MASKED_LM``,
``CLASSIFIER`` ...) rather than a family. Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpzoo.models.families import family, model_class
from tpzoo.models.presets import get_preset, preset_family

if TYPE_CHECKING:
    import torch

HF_VOCAB, HF_HEADS = 101, 4  # the tiny Hugging Face models' vocabulary and attention heads


@dataclass(frozen=True)
class Case:
    name: str                                               # its key in CASES, and in test ids
    preset: str
    model: str                                              # class name (tpzoo.models.build.build_model)
    inputs: str                                             # causal-lm | masked-lm | classification
    head: str                                               # num_parameters' head
    options: dict[str, Any] = field(default_factory=dict)   # constructor options
    changes: dict[str, Any] = field(default_factory=dict)   # config changes on top of the test's sizes
    hf: dict[str, Any] = field(default_factory=dict)        # its tiny Hugging Face model's config fields

    @property
    def family(self) -> str:
        """The family of its preset: what ``--model`` names, and its configs' ``model_type``."""
        return preset_family(self.preset)

    @property
    def model_class(self) -> type:
        return model_class(self.model)

    @property
    def architecture(self) -> str:
        """The Hugging Face class of its model class and options, as the family's adapter maps them."""
        from tpzoo.convert.mapping import architecture_of

        return architecture_of(self.model, self.options)

    @property
    def hf_model_type(self) -> str:
        """The ``model_type`` of its family's Hugging Face configs."""
        return family(self.family).spec.hf.model_type

    def config(self, **changes: Any):
        return get_preset(self.preset, **{**self.changes, **changes})

    def build(self, config, plan, **stage):
        from tpzoo.models.build import build_model

        return build_model(self.model, config, plan, **self.options, **stage)


# the tiny Hugging Face models' config fields per family: no dropout, eager attention, and for Llama RoPE
# theta and RMSNorm epsilon off their defaults (a converter that dropped them would change the logits)
_HF = dict(vocab_size=HF_VOCAB, attn_implementation="eager")
_HF_GPT2 = dict(_HF, n_positions=16, n_embd=32, n_layer=2, n_head=HF_HEADS, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, bos_token_id=HF_VOCAB - 1, eos_token_id=HF_VOCAB - 1)
_HF_BERT = dict(_HF, hidden_size=32, num_hidden_layers=2, num_attention_heads=HF_HEADS, intermediate_size=64,
                max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
                tie_word_embeddings=True)
_HF_LLAMA = dict(_HF, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=HF_HEADS,
                 max_position_embeddings=32, rms_norm_eps=1e-4, rope_theta=500.0)

# Llama 3.x's scaled rotary positions at the tiny models' sizes: an original context of 16 of 32 positions, so the
# base 500 makes some frequencies slowed, some blended and some kept
_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16)
WINDOW = 4  # the sliding window of the Mistral case: shorter than the tests' prompts and sequences

CASES: dict[str, Case] = {case.name: case for case in (
    Case("gpt", "gpt-tiny", "GPTModel", "causal-lm", "lm", hf=dict(_HF_GPT2, tie_word_embeddings=True)),
    Case("gpt-untied", "gpt-tiny", "GPTModel", "causal-lm", "lm", changes={"tie_word_embeddings": False},
         hf=dict(_HF_GPT2, tie_word_embeddings=False)),
    Case("bert", "bert-tiny", "BertModel", "masked-lm", "pretraining", {"add_binary_head": True}, hf=_HF_BERT),
    Case("bert-mlm", "bert-tiny", "BertModel", "masked-lm", "mlm", {"add_binary_head": False}, hf=_HF_BERT),
    Case("bert-cls", "bert-tiny", "BertForSequenceClassification", "classification", "classification", hf=_HF_BERT),
    Case("llama", "llama-tiny", "LlamaModel", "causal-lm", "lm", changes={"num_query_groups": 2},
         hf=dict(_HF_LLAMA, num_key_value_heads=2, tie_word_embeddings=False)),
    Case("llama-tied-mha", "llama-tiny", "LlamaModel", "causal-lm", "lm",
         changes={"num_query_groups": None, "tie_word_embeddings": True},
         hf=dict(_HF_LLAMA, num_key_value_heads=HF_HEADS, tie_word_embeddings=True)),
    Case("llama3", "llama-tiny", "LlamaModel", "causal-lm", "lm",
         changes={"num_query_groups": 2, "rope_scaling": True, "rope_original_max_positions": 16},
         hf=dict(_HF_LLAMA, num_key_value_heads=2, tie_word_embeddings=False, rope_scaling=_LLAMA3_ROPE)),
    Case("qwen2", "qwen2-tiny", "Qwen2Model", "causal-lm", "lm", changes={"num_query_groups": 2},
         hf=dict(_HF_LLAMA, num_key_value_heads=2, tie_word_embeddings=True)),
    Case("qwen3", "qwen3-tiny", "Qwen3Model", "causal-lm", "lm", changes={"num_query_groups": 2, "kv_channels": 12},
         hf=dict(_HF_LLAMA, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)),
    Case("mistral", "mistral-tiny", "MistralModel", "causal-lm", "lm",
         changes={"num_query_groups": 2, "window_size": WINDOW},
         hf=dict(_HF_LLAMA, num_key_value_heads=2, sliding_window=WINDOW, tie_word_embeddings=False)),
    # a mixture of experts in every layer: 4 experts, top 2 (the tiny Hugging Face model's expert width, 96)
    Case("mixtral", "mixtral-tiny", "MixtralModel", "causal-lm", "lm", changes={"num_query_groups": 2},
         hf=dict(_HF_LLAMA, num_key_value_heads=2, tie_word_embeddings=False, num_local_experts=4,
                 num_experts_per_tok=2)),
    # with the router's per-sequence losses in the training loss (load balance and z-loss)
    Case("mixtral-aux", "mixtral-tiny", "MixtralModel", "causal-lm", "lm",
         changes={"num_query_groups": 2, "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}),
    # Megatron-LM's MoE options: sigmoid scores, the load balance over each micro-batch, a capacity factor dropping
    # tokens (the engine test runs it with the experts as one grouped multiply)
    Case("mixtral-options", "mixtral-tiny", "MixtralModel", "causal-lm", "lm",
         changes={"num_query_groups": 2, "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01,
                  "moe_router_score_function": "sigmoid", "moe_router_load_balancing_type": "aux_loss",
                  "moe_expert_capacity_factor": 1.0}),
    # Qwen2-MoE: biases on q, k and v, 4 experts of 48, top 2, their scores not renormalised, a gated shared expert
    Case("qwen2_moe", "qwen2-moe-tiny", "Qwen2MoeModel", "causal-lm", "lm",
         changes={"num_query_groups": 2, "moe_ffn_hidden_size": 48, "moe_shared_expert_intermediate_size": 80},
         hf=dict(_HF_LLAMA, num_key_value_heads=2, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=48, shared_expert_intermediate_size=80, norm_topk_prob=False)),
    # packed examples (``document_ids``): each kept to itself, learned positions counted from its start
    Case("gpt-packed", "gpt-tiny", "GPTModel", "packed-lm", "lm"),
    # decoders as classifiers, read at the last real token (padding on the right, never a real token's id)
    Case("gpt-cls", "gpt-tiny", "GPTForSequenceClassification", "classification", "classification",
         changes={"num_labels": 3}, hf=dict(_HF_GPT2, tie_word_embeddings=True, num_labels=3, pad_token_id=0)),
    Case("llama-cls", "llama-tiny", "LlamaForSequenceClassification", "classification", "classification",
         changes={"num_query_groups": 2, "num_labels": 3},
         hf=dict(_HF_LLAMA, num_key_value_heads=2, tie_word_embeddings=False, num_labels=3, pad_token_id=0)),
)}
# one case per family and input kind: what the costlier checks (pipeline stages, recompute, engine) run
MAIN = ("gpt", "bert", "bert-cls", "llama", "qwen2", "qwen3", "mistral")
# the decoders Hugging Face's checkpoints of today come as: each family's traits, converted both ways
QKV_BIAS_LM = CASES["qwen2"]                # biases on q, k and v only, a tied output layer
QK_NORM_LM = CASES["qwen3"]                 # RMSNorm on each head's queries and keys, a head size not h / n
WINDOW_LM = CASES["mistral"]                # sliding-window attention (``WINDOW`` tokens)
SCALED_ROPE_LM = CASES["llama3"]            # Llama 3.x's scaled rotary frequencies
MOE_LM = CASES["mixtral"]                   # mixtures of experts in place of the MLPs
SHARED_MOE_LM = CASES["qwen2_moe"]          # and a gated shared expert beside them, scores not renormalised
MOE_AUX_LM = CASES["mixtral-aux"]           # and their router's losses in the training loss
MOE_OPTIONS_LM = CASES["mixtral-options"]   # and sigmoid scores, the balance per micro-batch, a capacity factor

# the roles: what a test needs, whichever family plays it
CAUSAL_LM = CASES["gpt"]                    # a causal LM: learned positions, tied output layer
CAUSAL_LM_UNTIED = CASES["gpt-untied"]      # the same with an untied output layer
GQA_LM = CASES["llama"]                     # a causal LM with grouped-query attention (2 kv heads of 4), rotary
                                            # positions, RMSNorm, SwiGLU and an untied output layer
GQA_LM_TIED_MHA = CASES["llama-tied-mha"]   # that family with one kv head per head and a tied output layer
MASKED_LM = CASES["bert"]                   # a masked LM with its binary (sentence-order) head
MASKED_LM_ONLY = CASES["bert-mlm"]          # a masked LM without the binary head
CLASSIFIER = CASES["bert-cls"]              # a sequence classifier
DECODER_CLASSIFIER = CASES["gpt-cls"]       # a causal LM's decoder as a classifier (its last real token)
GQA_CLASSIFIER = CASES["llama-cls"]         # the same of the grouped-query family
PACKED_LM = CASES["gpt-packed"]             # a causal LM on packed examples (document_ids)
# what the engine's mesh matrix trains besides MAIN's pretraining models: packed examples, and its classifiers
ENGINE_PRETRAINING = (PACKED_LM.name,)
ENGINE_CLASSIFIERS = (CLASSIFIER.name, GQA_CLASSIFIER.name)
PRETRAIN_DEFAULT = CAUSAL_LM                # the family pretrain.py trains without --model
# full-size presets, checked against the published (Hugging Face) parameter counts
CAUSAL_LM_SMALL = "gpt2"                    # GPT-2 small: 124,439,808 parameters
CAUSAL_LM_XL = "gpt2-xl"                    # GPT-2 XL: 1,557,611,200
GQA_LM_1B = "llama-1b"                      # TinyLlama-1.1B's shape: 1,100,048,384
MASKED_LM_BASE = "bert-base"                # BERT-base
MASKED_LM_LARGE = "bert-large"              # BERT-large: 335,174,458 with its MLM head
# the published parameter counts of today's decoders (their model cards and Hugging Face's safetensors index)
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "mistral-7b": 7_241_732_096,
             "llama3.2-1b": 1_235_814_400, "mixtral-8x7b": 46_702_792_704, CAUSAL_LM_SMALL: 124_439_808}
HUB_NAME = "gpt2"                           # a model name of the Hugging Face hub (tpzoo never downloads one)
OTHER_HEAD = "BertForQuestionAnswering"     # a Hugging Face class of MASKED_LM's model type that tpzoo lacks


def hf_config(case: Case, **changes: Any):
    """The config of ``case``'s tiny Hugging Face model: ``case.hf`` and ``changes`` in the config class of
    its family's Hugging Face model type."""
    import transformers

    return transformers.AutoConfig.for_model(case.hf_model_type, **{**case.hf, **changes})


def hf_class(case: Case) -> type:
    """The transformers class of ``case``'s Hugging Face architecture."""
    import transformers

    return getattr(transformers, case.architecture)


def hf_model(case: Case, **changes: Any) -> torch.nn.Module:
    """``case``'s tiny Hugging Face model (``hf_config``), random (seeded), every parameter perturbed."""
    import torch

    torch.manual_seed(0)
    return randomize(hf_class(case)(hf_config(case, **changes)))


def randomize(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Perturb every parameter (LayerNorm weights and biases included) so no mapping hides behind 1s and 0s."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def batch(case: Case, ids: torch.Tensor, generator: torch.Generator, classes: int = 3) -> dict[str, torch.Tensor]:
    """The keyword arguments of ``case``'s model for token ids [b, s]: inputs and every label key."""
    import torch

    b, s = ids.shape
    if case.inputs in ("causal-lm", "packed-lm"):
        out = dict(input_ids=ids, labels=torch.cat([ids[:, 1:], torch.full((b, 1), -100)], 1))
        if case.inputs == "packed-lm":  # 1 to 3 examples a row, the last target of each ignored
            ends = torch.rand(b, s, generator=generator) < 2 / s
            out["document_ids"] = ends.long().cumsum(1)
            out["labels"][:, :-1][out["document_ids"][:, 1:] != out["document_ids"][:, :-1]] = -100
        return out
    mask = torch.ones(b, s, dtype=torch.long)
    mask[b - 1, s - max(1, s // 4):] = 0                                  # padding at the end of the last sample
    out = dict(input_ids=ids, attention_mask=mask)
    from tpzoo.models.base import reads_token_types

    if reads_token_types(case.model_class):
        out["token_type_ids"] = (torch.arange(s) >= s // 2).long().expand(b, s).clone()
    if case.inputs == "classification":
        return dict(out, labels=torch.randint(0, classes, (b,), generator=generator))
    labels = torch.where((torch.rand(b, s, generator=generator) < 0.3) & (mask == 1), ids, -100)
    labels[0, 0] = ids[0, 0]                                              # at least one MLM target
    return dict(out, labels=labels, next_sentence_label=torch.randint(0, 2, (b,), generator=generator))


def without_labels(kwargs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in kwargs.items() if k not in ("labels", "next_sentence_label")}
