"""Mixtral (Jiang et al. 2024): Mistral's decoder whose MLPs are mixtures of experts (``tpzoo.models.moe.MoE``: top-k
of N SwiGLU experts, softmax scores renormalised over the chosen); the block library's decoder built from a
``MixtralConfig``, split by ``MIXTRAL_PLAN`` (the decoder's plan, each layer's experts split over tp).

    model = MixtralModel(get_preset("mixtral-8x7b"))   # plain PyTorch, one device: 8 experts of 14336, top 2

Hugging Face ``MixtralForCausalLM`` and ``MixtralForSequenceClassification`` convert both ways, from the layout
their checkpoints are saved in (``block_sparse_moe.experts.E.w1/w2/w3``, gate up and down); the router's jitter
noise is refused. Hugging Face's load-balancing loss (``router_aux_loss_coef``, with ``output_router_logits``) counts
a token's k slots as k tokens over the whole batch: tpzoo's is per sequence (``MoE.router_losses``), so its
coefficient is k times Hugging Face's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpzoo.models.causal_lm import CLASSIFIER_PLAN, DECODER_PLAN, CausalLM, SequenceClassifier
from tpzoo.models.config import MixtralConfig
from tpzoo.models.hf_rules import Rule, gated, require, same
from tpzoo.models.llama import (config_from_hf, config_to_hf, llama_like_spec, num_parameters as llama_parameters,
                                rules as llama_rules)
from tpzoo.models.moe import MOE_PLAN, MoE
from tpzoo.sharding_plan import ShardingPlan, prefixed

_EXPERTS = ShardingPlan(prefixed("layers.*.mlp", MOE_PLAN), tp_divides=("moe_ffn_hidden_size",))
MIXTRAL_PLAN = DECODER_PLAN | _EXPERTS


class MixtralModel(CausalLM):
    """Mixtral: ``MistralModel``'s parts, each layer's MLP a mixture of experts."""

    model_type = "mixtral"
    config_class = MixtralConfig
    sharding = MIXTRAL_PLAN

    def build_mlp(self, layer_number: int) -> nn.Module:
        c = self.config
        return MoE(c.hidden_size, c.num_experts, c.moe_router_topk, c.expert_ffn_size, activation=c.activation,
                   score=c.moe_router_score_function, aux_loss_coeff=c.moe_aux_loss_coeff,
                   z_loss_coeff=c.moe_z_loss_coeff, load_balancing=c.moe_router_load_balancing_type,
                   capacity_factor=c.moe_expert_capacity_factor, init_std=c.init_method_std,
                   out_init_std=self.output_init_std(), **self.moe_options())

    def moe_options(self) -> dict[str, Any]:
        """The ``MoE`` options a family adds (Mixtral: none; its routing renormalised, no shared expert)."""
        return {}


class MixtralForSequenceClassification(SequenceClassifier, MixtralModel):
    """Mixtral as a classifier (Hugging Face's MixtralForSequenceClassification): ``score`` at the last real token."""

    sharding = CLASSIFIER_PLAN | _EXPERTS


def num_parameters(c: MixtralConfig, head: str | None = None) -> int:
    """Llama's count with each layer's MLP [3 f h] replaced by N experts [3 f_e h] and the router [N h] (and a shared
    expert [3 f_s h] with its gate [h], where the config has one)."""
    dense_mlp = 3 * c.ffn_size * c.hidden_size
    moe = c.num_experts * (3 * c.expert_ffn_size * c.hidden_size + c.hidden_size)
    shared = getattr(c, "moe_shared_expert_intermediate_size", None)
    moe += (3 * shared + 1) * c.hidden_size if shared else 0
    return llama_parameters(c, head) + c.num_layers * (moe - dense_mlp)


def _from_hf(hf: Any, arch: str) -> MixtralConfig:
    require(not getattr(hf, "router_jitter_noise", 0.0), f"router_jitter_noise={hf.router_jitter_noise}")
    coeff = hf.router_aux_loss_coef * hf.num_experts_per_tok if getattr(hf, "output_router_logits", False) else 0.0
    return config_from_hf(hf, arch, MixtralConfig, window_size=hf.sliding_window, num_experts=hf.num_local_experts,
                          moe_router_topk=hf.num_experts_per_tok, moe_aux_loss_coeff=coeff)


def router_to_hf(c: MixtralConfig) -> dict[str, Any]:
    """The router's fields of a Hugging Face config (its load-balancing coefficient: tpzoo's / k); a sigmoid router
    is refused (Hugging Face's take a softmax). The capacity factor drops tokens in training only: the converted
    model computes as tpzoo's evaluates, dropless."""
    score = c.moe_router_score_function
    require(score == "softmax", f"moe_router_score_function={score} (Hugging Face's routers take a softmax)")
    k = c.moe_router_topk
    return dict(num_experts_per_tok=k, output_router_logits=c.moe_aux_loss_coeff > 0,
                router_aux_loss_coef=c.moe_aux_loss_coeff / k)


def _to_hf(c: MixtralConfig, arch: str) -> Any:
    """The Hugging Face config: the expert width is its ``intermediate_size`` (Mixtral has no dense MLP)."""
    dense = c.replace(ffn_hidden_size=c.expert_ffn_size, moe_ffn_hidden_size=None)
    return config_to_hf(dense, "MixtralConfig", arch, sliding_window=c.window_size, num_local_experts=c.num_experts,
                        **router_to_hf(c))


def _stacked(tpzoo: str, per_expert: list[Rule]) -> Rule:
    """One stacked [N, ...] tensor of the experts' ``per_expert`` rules (each one expert's tensor)."""
    sizes = [len(r.hf) for r in per_expert]

    def to_tpzoo(*tensors: torch.Tensor) -> torch.Tensor:
        pieces, start = [], 0
        for rule, n in zip(per_expert, sizes):
            pieces.append(rule.to_tpzoo(*tensors[start:start + n]))
            start += n
        return torch.stack(pieces)

    def to_hf(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x for rule, expert in zip(per_expert, t.unbind(0)) for x in rule.to_hf(expert))

    return Rule(tpzoo, tuple(name for r in per_expert for name in r.hf), to_tpzoo, to_hf)


def moe_rules(c: MixtralConfig, arch: str, block: str, gate: str, up: str, down: str) -> list[Rule]:
    """Llama's rules but the MLPs': per layer the router (``<block>.gate``) and the experts stacked, gate and up
    interleaved as the MLP's, down (Hugging Face's names of each expert's: ``gate``, ``up``, ``down``)."""
    out = [r for r in llama_rules(c, arch) if ".mlp." not in r.tpzoo]
    for i in range(c.num_layers):
        t, h = f"layers.{i}.mlp.", f"model.layers.{i}.{block}."
        experts = range(c.num_experts)
        out += [same(f"{t}router.weight", f"{h}gate.weight"),
                _stacked(f"{t}experts.dense_h_to_4h",
                         [gated("", f"{h}experts.{e}.{gate}.weight", f"{h}experts.{e}.{up}.weight") for e in experts]),
                _stacked(f"{t}experts.dense_4h_to_h", [same("", f"{h}experts.{e}.{down}.weight") for e in experts])]
    return out


def rules(c: MixtralConfig, arch: str) -> list[Rule]:
    """Mixtral's: ``block_sparse_moe``, each expert's gate w1, up w3, down w2."""
    return moe_rules(c, arch, "block_sparse_moe", "w1", "w3", "w2")


SPEC = llama_like_spec(MixtralModel, MixtralForSequenceClassification, "MixtralConfig", _from_hf, to_hf=_to_hf,
                       count=num_parameters, hf_rules=rules)
