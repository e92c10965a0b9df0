"""The mixture of experts' options (issue 28, Megatron-LM's flags): the experts as one grouped multiply
(``--moe-grouped-gemm``: the outputs and every gradient bit for bit the loop's, an expert without tokens included;
misaligned sizes refused naming them), the load-balancing loss over each micro-batch (``aux_loss``, Megatron-LM's
default) against a written-out reference and over none, the capacity factor (in training each expert keeps its
heaviest slots up to ceil(T k / N x factor), the others dropped, against a written-out reference; evaluation
dropless), the config's and the block's misuse, the sigmoid router refused by the conversion to Hugging Face; and at
ep 2 the grouped multiply and the capacity factor give each rank the plain module's outputs on its own tokens."""

from __future__ import annotations

import math

import pytest
import torch

from tpzoo.models.config import MixtralConfig
from tpzoo.models.grouped_mm import check_grouped_sizes, grouped_mm
from tpzoo.models.moe import MoE
from tpzoo.models.presets import get_preset
from tpzoo.parallel import ParallelPlan, init_mesh, parallelize
from tpzoo.parallel.experts import expert_parallel
from tpzoo.sharding_plan import ShardingPlan
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("unit")

H, F, E, B, S = 16, 12, 6, 2, 7


def grads_of(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_()
    out = moe(x)
    out.square().sum().backward()
    return out.detach(), {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_gemm_is_the_loop_bit_for_bit(activation):
    torch.manual_seed(0)
    loop = MoE(H, E, 2, F, activation=activation, shared_ffn_hidden_size=8, aux_loss_coeff=0.1)
    grouped = MoE(H, E, 2, F, activation=activation, shared_ffn_hidden_size=8, aux_loss_coeff=0.1)
    grouped.load_state_dict(loop.state_dict())
    grouped.experts.grouped_gemm = True  # what ParallelPlan(grouped_gemm=True) sets (``_options_at_ep2``)
    with torch.no_grad():  # no token prefers expert 5: an empty group in each multiply
        for moe in (loop, grouped):
            moe.router.weight[5] = -1.0  # inputs > 0 below
    x = torch.rand(B, S, H, generator=torch.Generator().manual_seed(1))
    (out, want), (got_out, got) = grads_of(loop, x), grads_of(grouped, x)
    assert torch.equal(got_out, out)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want), [
        k for k in want if not torch.equal(got[k], want[k])]
    assert want["experts.dense_h_to_4h"][5].abs().sum() == 0


def test_grouped_mm_of_empty_and_full_groups():
    x, w = torch.randn(10, 8), torch.randn(3, 4, 8)
    ends = torch.tensor([0, 10, 10], dtype=torch.int32)
    assert torch.equal(grouped_mm(x, w, ends), x @ w[1].t())


@pytest.mark.parametrize("dtype, sizes, message", [
    (torch.float32, dict(hidden=16, expert_ffn=6),
     "expert_ffn 6 features of torch.float32 are no multiple of 16 bytes"),
    (torch.bfloat16, dict(hidden=12, expert_ffn=16),
     "hidden 12 features of torch.bfloat16 .* a multiple of 8 features"),
])
def test_grouped_gemm_refuses_misaligned_sizes(dtype, sizes, message):
    check_grouped_sizes(dtype, hidden=16, expert_ffn=16)
    with pytest.raises(ValueError, match=message):
        check_grouped_sizes(dtype, **sizes)


def test_load_balancing_over_the_micro_batch_is_one_sequence_of_its_tokens():
    """``aux_loss``: the balance of the micro-batch's tokens taken together, counted once per sequence (so that the
    training loss's weight per sequence gives each micro-batch's balance its share); the z-loss as per sequence."""
    torch.manual_seed(0)
    per_seq = MoE(H, E, 2, F, aux_loss_coeff=0.1)
    per_batch = MoE(H, E, 2, F, aux_loss_coeff=0.1, load_balancing="aux_loss")
    per_batch.load_state_dict(per_seq.state_dict())
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(2))
    _, indices, logits = per_seq.route(x.reshape(-1, H))
    balance, z, load = per_batch.router_losses(logits, indices, B)
    one, _, _ = per_seq.router_losses(logits, indices, 1)  # all B x S tokens as one sequence
    seq_balance, seq_z, seq_load = per_seq.router_losses(logits, indices, B)
    assert torch.allclose(balance, B * one, rtol=1e-6) and not torch.allclose(balance, seq_balance, rtol=1e-3)
    assert torch.allclose(z, seq_z, rtol=1e-6) and torch.equal(load, seq_load)
    none = MoE(H, E, 2, F, load_balancing="none")
    none.load_state_dict(per_seq.state_dict())
    none(x).sum().backward()
    assert set(none.losses) == {"load_balancing_loss", "z_loss", "tokens_per_expert"}  # logged, not trained on


def kept_slots(weights: torch.Tensor, indices: torch.Tensor, factor: float) -> torch.Tensor:
    """Written out: each expert keeps its ceil(T k / N x factor) heaviest slots (the earlier of equal ones)."""
    t, k = indices.shape
    capacity = math.ceil(t * k / E * factor)
    keep = torch.zeros(t * k, dtype=torch.bool)
    w, e = weights.flatten().tolist(), indices.flatten().tolist()
    for expert in range(E):
        slots = sorted((i for i in range(t * k) if e[i] == expert), key=lambda i: (-w[i], i))
        keep[slots[:capacity]] = True
    return keep.view(t, k)


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_factor_drops_the_lightest_slots_in_training_only(factor):
    torch.manual_seed(0)
    moe = MoE(H, E, 2, F, capacity_factor=factor)
    plain = MoE(H, E, 2, F)
    plain.load_state_dict(moe.state_dict())
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(3))
    flat = x.reshape(-1, H)
    weights, indices, _ = plain.route(flat)
    keep = kept_slots(weights, indices, factor)
    assert 0 < keep.sum() < keep.numel()  # something dropped: the test means something
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(2):
            if keep[t, j]:
                want[t] += weights[t, j] * plain.experts.expert(int(indices[t, j]), flat[t:t + 1])[0]
    got = moe(x)
    assert torch.allclose(got.reshape(-1, H), want, atol=1e-6), (got.reshape(-1, H) - want).abs().max()
    moe.eval(), plain.eval()
    assert torch.equal(moe(x), plain(x))  # evaluation: dropless


@pytest.mark.parametrize("kwargs, message", [
    (dict(load_balancing="sinkhorn"), "load_balancing must be one of seq_aux_loss, aux_loss, none"),
    (dict(load_balancing="none", aux_loss_coeff=0.1), "not none with aux_loss_coeff > 0"),
    (dict(capacity_factor=0.0), "capacity_factor must be > 0 .* got 0.0"),
])
def test_misuse_of_the_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoE(H, E, 2, F, **kwargs)


def test_config_misuse_and_the_sigmoid_router_has_no_hugging_face_twin():
    tiny = get_preset("mixtral-tiny")
    with pytest.raises(ValueError, match="--moe-router-load-balancing-type none adds no load-balancing loss for "
                                         "--moe-aux-loss-coeff 0.1 to weigh; drop one of them"):
        tiny.replace(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.1)
    with pytest.raises(ValueError, match="moe_expert_capacity_factor"):
        MixtralConfig(moe_expert_capacity_factor=-1.0)
    from tpzoo.convert.mapping import ConversionError, config_to_hf

    with pytest.raises(ConversionError, match=r"moe_router_score_function=sigmoid \(Hugging Face's routers take a "
                                              r"softmax\)"):
        config_to_hf(tiny.replace(moe_router_score_function="sigmoid"), "MixtralForCausalLM")


def _options_at_ep2() -> dict[str, float]:
    """At ep 2 (3 of 6 experts a rank), grouped and with a capacity factor: each rank's outputs and input gradients
    are the plain module's on its own tokens (drops are decided on a rank's tokens, before they leave it); and
    ``ParallelPlan(grouped_gemm=True)`` sets the experts' switch (0: it did)."""
    import torch.distributed as dist

    mesh = init_mesh(dp=2)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(20 + dist.get_rank()))
    planned = parallelize(MoE(H, E, 2, F), ParallelPlan(mesh, grouped_gemm=True), ShardingPlan({}))
    found = {"plan sets grouped_gemm": float(not planned.experts.grouped_gemm)}
    for name, options in (("grouped", {}), ("capacity", dict(capacity_factor=0.75))):
        torch.manual_seed(0)
        plain, split = MoE(H, E, 2, F, **options), MoE(H, E, 2, F, **options)
        split.load_state_dict(plain.state_dict())
        expert_parallel(split.experts, mesh.dp_group)
        split.experts.grouped_gemm = name == "grouped"
        (want, want_grads), (got, got_grads) = grads_of(plain, x), grads_of(split, x)
        found[name] = max(((got - want).abs().max() / want.abs().max()).item(),
                          ((got_grads["x"] - want_grads["x"]).abs().max() / want_grads["x"].abs().max()).item())
    return found


@pytest.mark.tier("distributed")
def test_grouped_gemm_and_capacity_at_ep2_equal_the_plain_module():
    for found in spawn(_options_at_ep2, 2):
        assert max(found.values()) < 1e-5, found
