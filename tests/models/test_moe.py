"""The mixture-of-experts MLP (``tpzoo.models.moe``) against Hugging Face's sparse MoE blocks with the same weights
(Mixtral: softmax, top-2 renormalised; Qwen2-MoE: top-k not renormalised, a gated shared expert), in float32,
outputs and input gradients; an expert no token reached gets a zero gradient; the router's losses per sequence
(against a written-out reference and Hugging Face's on one sequence), joining the gradient alike however the batch is
split; misuse;
and at tp 2 with ``MOE_PLAN`` (one all-reduce for all experts) the outputs and every gathered gradient of the plain
module, with and without sequence parallelism; with expert parallelism over 2 ranks (each holding 3 of the 6
experts, tokens sent to them and back by all-to-all) each rank's outputs and input gradients of the plain module's on
its own tokens, each held expert's gradient the plain one summed over both ranks' tokens."""

from __future__ import annotations

import pytest
import torch
import transformers

from tpzoo.models.moe import MOE_PLAN, MoE
from tpzoo.models.sharding import full_grads
from tpzoo.parallel import ParallelPlan, init_mesh, parallelize, sync_sequence_parallel_grads
from tpzoo.parallel.experts import expert_parallel
from tpzoo.sharding_plan import ShardingPlan
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("unit")

H, F, E, B, S = 16, 12, 6, 2, 7
COEFFS = dict(aux_loss_coeff=0.1, z_loss_coeff=0.01)


def interleaved(gate_up: torch.Tensor) -> torch.Tensor:
    """Hugging Face's [2f, h] expert weight (gate rows, then up rows) as the MLP's [g_0 u_0 g_1 u_1 ...]."""
    gate, up = gate_up.chunk(2)
    return torch.stack([gate, up], 1).reshape(gate_up.shape)


def load_from_hf(moe: MoE, hf: torch.nn.Module) -> None:
    with torch.no_grad():
        moe.router.weight.copy_(hf.gate.weight)
        moe.experts.dense_h_to_4h.copy_(torch.stack([interleaved(w) for w in hf.experts.gate_up_proj]))
        moe.experts.dense_4h_to_h.copy_(hf.experts.down_proj)
        if moe.shared_expert is not None:
            shared = hf.shared_expert
            moe.shared_expert.dense_h_to_4h.weight.copy_(
                interleaved(torch.cat([shared.gate_proj.weight, shared.up_proj.weight])))
            moe.shared_expert.dense_4h_to_h.weight.copy_(shared.down_proj.weight)
            moe.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)


def hf_block(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = transformers.MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E,
                                            num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(config)
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        config = transformers.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E,
                                             num_experts_per_tok=3, norm_topk_prob=False,
                                             shared_expert_intermediate_size=2 * F)
        block = Qwen2MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block.eval()


def ours(kind: str) -> MoE:
    if kind == "mixtral":
        return MoE(H, E, 2, F)
    return MoE(H, E, 3, F, normalize=False, shared_ffn_hidden_size=2 * F, shared_gate=True)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_equals_hugging_face_sparse_moe_block(kind):
    hf, moe = hf_block(kind), ours(kind)
    load_from_hf(moe, hf)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    expected = hf(x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    (dx_expected,) = torch.autograd.grad(expected.square().sum(), x)
    got = moe(x)
    (dx,) = torch.autograd.grad(got.square().sum(), x)
    scale = expected.abs().max()
    assert got.shape == x.shape and (got - expected).abs().max() <= 1e-6 * scale, (got - expected).abs().max()
    assert (dx - dx_expected).abs().max() <= 1e-5 * dx_expected.abs().max()


def test_an_expert_no_token_reached_gets_a_zero_gradient():
    moe = MoE(H, E, 1, F)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0  # every token prefers expert 2 (inputs > 0 below)
    moe(torch.rand(B, S, H) + 0.1).sum().backward()
    for weight in (moe.experts.dense_h_to_4h, moe.experts.dense_4h_to_h):
        assert [bool(g.abs().sum() > 0) for g in weight.grad] == [e == 2 for e in range(E)]
    assert moe.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=7), "top_k=7 must be between 1 and num_experts=6"),
    (dict(score="relu"), "score must be one of softmax, sigmoid, got 'relu'"),
    (dict(shared_gate=True), "shared_gate=True gates the shared expert; give shared_ffn_hidden_size too"),
    (dict(z_loss_coeff=-1.0), "the router's loss coefficients must be >= 0, got aux_loss_coeff=0.0, z_loss_coeff=-1.0"),
])
def test_misuse_names_the_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoE(H, E, kwargs.pop("top_k", 2), F, **kwargs)


def reference_losses(logits: torch.Tensor, k: int, score: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """The router's losses of [b, s, N] logits written out sequence by sequence: (sum of N sum_e f_e P_e, sum of the
    mean logsumexp^2)."""
    balance, z = 0.0, 0.0
    for seq in logits.float():
        s, n = seq.shape
        p = seq.softmax(-1) if score == "softmax" else seq.sigmoid() / seq.sigmoid().sum(-1, keepdim=True)
        chosen = torch.zeros(n)
        for row in (seq.softmax(-1) if score == "softmax" else seq.sigmoid()).topk(k, -1).indices:
            chosen[row] += 1
        balance = balance + n * (chosen / (s * k) * p.mean(0)).sum()
        z = z + seq.logsumexp(-1).square().mean()
    return balance, z


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_losses_are_per_sequence_and_hugging_faces_on_one(score):
    moe = MoE(H, E, 2, F, score=score, **COEFFS)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(4))
    weights, indices, logits = moe.route(x.reshape(-1, H))
    balance, z, _ = moe.router_losses(logits, indices, B)
    want = reference_losses(logits.view(B, S, E), 2, score)
    assert torch.allclose(balance, want[0], rtol=1e-6) and torch.allclose(z, want[1], rtol=1e-6), (balance, z, want)
    if score == "softmax":  # Hugging Face's counts the k slots of a token as k tokens: k times ours on one sequence
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        one = moe.router_losses(logits[:S], indices[:S], 1)[0]
        assert torch.allclose(load_balancing_loss_func((logits[:S],), E, 2), 2 * one, rtol=1e-6)


def test_router_losses_join_the_gradient_per_sequence_however_the_batch_is_split():
    """Training: the gradient of out^2 summed is that of out^2 plus the coefficients times the mean of each
    sequence's losses; two forwards of one sequence each, weighted 1/2 a sequence, give the same gradients."""
    torch.manual_seed(0)
    moe = MoE(H, E, 2, F, **COEFFS)
    plain = MoE(H, E, 2, F)
    plain.load_state_dict(moe.state_dict())
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(5))
    plain(x).square().sum().backward()
    _, indices, logits = plain.route(x.reshape(-1, H))
    balance, z = reference_losses(logits.view(B, S, E), 2)
    ((COEFFS["aux_loss_coeff"] * balance + COEFFS["z_loss_coeff"] * z) / B).backward()
    want = {n: p.grad.clone() for n, p in plain.named_parameters()}
    moe(x).square().sum().backward()
    assert set(moe.losses) == {"load_balancing_loss", "z_loss", "tokens_per_expert"}
    assert torch.allclose(moe.losses["z_loss"], z)
    assert torch.equal(moe.losses["tokens_per_expert"], torch.bincount(indices.flatten(), minlength=E).float())
    for name, p in moe.named_parameters():
        assert torch.allclose(p.grad, want[name], rtol=1e-5, atol=1e-7), name
    moe.zero_grad()
    moe.sequence_weight = 1 / B
    for half in x.split(1):
        moe(half).square().sum().backward()
    for name, p in moe.named_parameters():
        assert torch.allclose(p.grad, want[name], rtol=1e-5, atol=1e-7), name


def _moe_at_tp2() -> dict[str, float]:
    """The Qwen2-MoE-like module (sigmoid scores here, to cover them) with its router losses on, at tp 2 against the
    plain one, without and with sequence parallelism (each rank its half of every sequence; the replicated weights'
    partial gradients summed)."""
    mesh = init_mesh(tp=2)
    x = torch.randn(B, 2 * S, H, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    plain = MoE(H, E, 2, F, score="sigmoid", shared_ffn_hidden_size=2 * F, shared_gate=True, **COEFFS)
    x_plain = x.clone().requires_grad_()
    y_plain = plain(x_plain)
    y_plain.square().sum().backward()
    want = {n: p.grad for n, p in plain.named_parameters()}
    found = {}
    for sp in (False, True):
        split = MoE(H, E, 2, F, score="sigmoid", shared_ffn_hidden_size=2 * F, shared_gate=True, **COEFFS)
        split.load_state_dict(plain.state_dict())
        split = parallelize(split, ParallelPlan(mesh, sequence_parallel=sp), ShardingPlan(MOE_PLAN))
        split.sequence_weight = 1 / B  # each rank holds every sequence (a part of each under sequence parallelism)
        mine = (lambda t: t.chunk(2, 1)[mesh.tp_rank]) if sp else (lambda t: t)
        x_in = mine(x).clone().requires_grad_()
        y = split(x_in)
        y.square().sum().backward()
        sync_sequence_parallel_grads(split, mesh.tp_group)
        grads = full_grads(split, mesh)
        found[f"sp={sp}"] = {
            "out": ((y - mine(y_plain)).abs().max() / y_plain.abs().max()).item(),
            "dx": ((x_in.grad - mine(x_plain.grad)).abs().max() / x_plain.grad.abs().max()).item(),
            "names": float(grads.keys() == want.keys()),
            "grads": max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in want.items()),
            "losses": max(((split.losses[k] - v).abs().max() / v.abs().max()).item() for k, v in plain.losses.items())}
    return found


@pytest.mark.tier("distributed")
def test_moe_at_tp2_equals_the_plain_module_with_and_without_sequence_parallelism():
    for found in spawn(_moe_at_tp2, 2):
        for sp in ("sp=False", "sp=True"):
            assert found[sp]["names"] == 1.0 and max(found[sp][k] for k in ("out", "dx", "grads", "losses")) < 1e-5, \
                found


def _moe_at_ep2() -> dict[str, float]:
    """Top-2 of 6 experts at ep 2: this rank's tokens through the experts of both ranks."""
    import torch.distributed as dist

    mesh = init_mesh(dp=2)
    rank = dist.get_rank()
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
    torch.manual_seed(0)
    plain = MoE(H, E, 2, F)
    split = MoE(H, E, 2, F)
    split.load_state_dict(plain.state_dict())
    expert_parallel(split.experts, mesh.dp_group)
    y_plain = plain(x)
    (dx_plain,) = torch.autograd.grad(y_plain.square().sum(), x, retain_graph=True)
    y_plain.square().sum().backward()
    x_split = x.detach().clone().requires_grad_()
    y = split(x_split)
    y.square().sum().backward()
    held = slice(rank * E // 2, (rank + 1) * E // 2)
    found = {"out": ((y - y_plain).abs().max() / y_plain.abs().max()).item(),
             "dx": ((x_split.grad - dx_plain).abs().max() / dx_plain.abs().max()).item(),
             "held": float(split.experts.dense_h_to_4h.shape[0])}
    for name in ("dense_h_to_4h", "dense_4h_to_h"):
        both = getattr(plain.experts, name).grad.clone()
        dist.all_reduce(both)  # the plain module's gradient over both ranks' tokens
        got = getattr(split.experts, name).grad
        found[name] = ((got - both[held]).abs().max() / both[held].abs().max()).item()
    found["router"] = ((split.router.weight.grad - plain.router.weight.grad).abs().max()
                       / plain.router.weight.grad.abs().max()).item()
    try:
        expert_parallel(MoE(H, 5, 2, F).experts, mesh.dp_group)
    except ValueError as e:
        found["misuse"] = str(e)
    return found


@pytest.mark.tier("distributed")
def test_moe_at_ep2_equals_the_plain_module_and_each_expert_sums_every_ranks_tokens():
    for found in spawn(_moe_at_ep2, 2):
        assert found["held"] == E // 2, found
        errors = [found[k] for k in ("out", "dx", "dense_h_to_4h", "dense_4h_to_h", "router")]
        assert max(errors) < 1e-5, found
        assert found["misuse"] == "expert parallelism: ep=2 does not divide the 5 experts; choose an ep dividing 5"


def test_a_compiled_mixtral_trains_as_the_eager_one(monkeypatch):
    """``ParallelPlan(compile=True)`` on Mixtral (aot_eager): its experts' loop breaks the graph (it reads the token
    counts on the host: ``Experts.routed`` runs eagerly), so the layers compile without fullgraph; 2 AdamW steps with
    the router's losses on give the eager losses within 1e-5."""
    from families import MOE_AUX_LM

    from tpzoo.models.compile import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    import torch.distributed as dist

    started = not dist.is_initialized()
    init_mesh()
    config = MOE_AUX_LM.config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=32, vocab_size=101)
    ids = torch.randint(0, 101, (2, S), generator=torch.Generator().manual_seed(6))
    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = MOE_AUX_LM.build(config, ParallelPlan(init_mesh(), kernels="torch", compile=compiled))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[compiled] = []
        for _ in range(2):
            loss = model(ids, labels=ids).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[compiled].append(loss.item())
    if started:  # the next tests of this process find no group
        dist.destroy_process_group()
    assert max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False])) < 1e-5, losses
