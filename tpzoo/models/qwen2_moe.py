"""Qwen2-MoE (Qwen1.5-MoE, Qwen team 2024): Qwen2's decoder (biases on q, k and v) whose MLPs are mixtures of experts
with a shared expert (``tpzoo.models.moe.MoE``: the top k of N SwiGLU experts by their softmax scores over all N, not
renormalised unless ``norm_topk_prob``, plus a shared SwiGLU expert, always on, its output gated by a sigmoid of the
input); built from a ``Qwen2MoeConfig``, split by ``QWEN2_MOE_PLAN`` (each layer's experts and shared expert over tp).

    model = Qwen2MoeModel(get_preset("qwen1.5-moe-a2.7b"))   # 60 experts of 1408, top 4, a shared expert of 5632

Hugging Face ``Qwen2MoeForCausalLM`` and ``Qwen2MoeForSequenceClassification`` convert both ways, from the layout
their checkpoints are saved in (``mlp.gate``, ``mlp.experts.E.gate_proj/up_proj/down_proj``, ``mlp.shared_expert``,
``mlp.shared_expert_gate``); dense MLP layers among the experts' (``decoder_sparse_step`` > 1, ``mlp_only_layers``)
and the sliding window are refused. The load-balancing loss relates to Hugging Face's as Mixtral's does
(``tpzoo.models.mixtral``).
"""

from __future__ import annotations

from typing import Any

from tpzoo.models.causal_lm import CLASSIFIER_PLAN, DECODER_PLAN, SequenceClassifier
from tpzoo.models.config import Qwen2MoeConfig
from tpzoo.models.hf_rules import Rule, gated, require, same
from tpzoo.models.llama import config_from_hf, config_to_hf, llama_like_spec
from tpzoo.models.mixtral import MixtralModel, moe_rules, num_parameters, router_to_hf
from tpzoo.models.moe import MOE_PLAN
from tpzoo.sharding_plan import ShardingPlan, prefixed

_EXPERTS = ShardingPlan(prefixed("layers.*.mlp", MOE_PLAN),
                        tp_divides=("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"))
QWEN2_MOE_PLAN = DECODER_PLAN | _EXPERTS


class Qwen2MoeModel(MixtralModel):
    """Qwen2-MoE: ``Qwen2Model``'s attention, each layer's MLP a mixture of experts beside a gated shared expert."""

    model_type = "qwen2_moe"
    config_class = Qwen2MoeConfig
    sharding = QWEN2_MOE_PLAN

    def moe_options(self) -> dict[str, Any]:
        shared = self.config.moe_shared_expert_intermediate_size
        return dict(normalize=self.config.norm_topk_prob, shared_ffn_hidden_size=shared, shared_gate=shared is not None)


class Qwen2MoeForSequenceClassification(SequenceClassifier, Qwen2MoeModel):
    """Qwen2-MoE as a classifier (Hugging Face's Qwen2MoeForSequenceClassification): ``score`` at the last real
    token."""

    sharding = CLASSIFIER_PLAN | _EXPERTS


def _from_hf(hf: Any, arch: str) -> Qwen2MoeConfig:
    require(not getattr(hf, "use_sliding_window", False), "use_sliding_window=True (Qwen2's per-layer window)")
    require(hf.decoder_sparse_step == 1 and not hf.mlp_only_layers, f"dense MLP layers among the mixtures of "
            f"experts (decoder_sparse_step={hf.decoder_sparse_step}, mlp_only_layers={hf.mlp_only_layers})")
    require(getattr(hf, "qkv_bias", True), "qkv_bias=False (Qwen2's attention has biases on q, k and v)")
    coeff = hf.router_aux_loss_coef * hf.num_experts_per_tok if getattr(hf, "output_router_logits", False) else 0.0
    return config_from_hf(hf, arch, Qwen2MoeConfig, num_experts=hf.num_experts, moe_router_topk=hf.num_experts_per_tok,
                          moe_ffn_hidden_size=hf.moe_intermediate_size, norm_topk_prob=hf.norm_topk_prob,
                          moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
                          moe_aux_loss_coeff=coeff)


def _to_hf(c: Qwen2MoeConfig, arch: str) -> Any:
    require(c.moe_shared_expert_intermediate_size is not None, "no shared expert (Hugging Face's Qwen2-MoE has one)")
    return config_to_hf(c, "Qwen2MoeConfig", arch, num_experts=c.num_experts, moe_intermediate_size=c.expert_ffn_size,
                        norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                        shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
                        use_sliding_window=False, **router_to_hf(c))


def rules(c: Qwen2MoeConfig, arch: str) -> list[Rule]:
    """Mixtral's rules under Qwen2-MoE's names (``mlp``, each expert's gate_proj, up_proj, down_proj), and the shared
    expert's (gate and up interleaved as the MLP's) and its gate's."""
    out = moe_rules(c, arch, "mlp", "gate_proj", "up_proj", "down_proj")
    for i in range(c.num_layers if c.moe_shared_expert_intermediate_size else 0):
        t, h = f"layers.{i}.mlp.shared_expert", f"model.layers.{i}.mlp.shared_expert"
        out += [gated(f"{t}.dense_h_to_4h.weight", f"{h}.gate_proj.weight", f"{h}.up_proj.weight"),
                same(f"{t}.dense_4h_to_h.weight", f"{h}.down_proj.weight"),
                same(f"{t}_gate.weight", f"{h}_gate.weight")]
    return out


SPEC = llama_like_spec(Qwen2MoeModel, Qwen2MoeForSequenceClassification, "Qwen2MoeConfig", _from_hf, to_hf=_to_hf,
                       count=num_parameters, hf_rules=rules)
