"""Global gradient norm, clipping and the agreed fp16 overflow decision on a tp=2 x pp=2 mesh (4 ranks)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tpzoo.engine.grads import any_nonfinite, clip_grad_norm, global_grad_norm
from tpzoo.engine.loss_scale import DynamicLossScaler
from tpzoo.parallel import init_mesh, mark
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")




def param(grad: list[float], **facts) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(len(grad)))
    p.grad = torch.tensor(grad)
    return mark(p, **facts)


def rank_params(pp_rank: int, tp_rank: int) -> list[nn.Parameter]:
    """Per rank: a tp shard (differs by tp rank), a tp replica (same on both tp ranks) and, on the
    first and last stage, the tied embedding (same on both stages)."""
    params = [param([1.0 + tp_rank + 10 * pp_rank, 2.0], tp_split_dim=0), param([3.0 + pp_rank])]
    params.append(param([5.0 + tp_rank, 1.0], tp_split_dim=0, pp_tied=True))
    return params


def expected_norm() -> float:
    """Each distinct element once: shards of every (pp, tp); replicas once per stage; the tied embedding once."""
    sq = 0.0
    for pp_rank in range(2):
        for tp_rank in range(2):
            sq += (1.0 + tp_rank + 10 * pp_rank) ** 2 + 2.0**2
        sq += (3.0 + pp_rank) ** 2
    sq += sum((5.0 + tp_rank) ** 2 + 1.0 for tp_rank in range(2))
    return math.sqrt(sq)


def grad_checks() -> None:
    mesh = init_mesh(tp=2, pp=2)
    params = rank_params(mesh.pp_rank, mesh.tp_rank)
    norm = global_grad_norm(params, mesh)
    assert norm.item() == pytest.approx(expected_norm(), rel=1e-6)

    before = [p.grad.clone() for p in params]
    assert clip_grad_norm(params, 1e9, mesh).item() == pytest.approx(expected_norm(), rel=1e-6)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before)), "a norm under max_norm must not clip"
    clip_grad_norm(params, 1.0, mesh)
    assert global_grad_norm(params, mesh).item() == pytest.approx(1.0, rel=1e-5)

    assert any_nonfinite(params).item() == 0
    if mesh.pp_rank == 1 and mesh.tp_rank == 0:
        params[0].grad[1] = float("inf")
    assert any_nonfinite(params).item() == 1, "one rank's inf must stop every rank's step"
    before = [p.grad.clone() for p in params]
    assert not math.isfinite(clip_grad_norm(params, 1.0, mesh).item())
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before)), "a non-finite norm must not clip"

    scaler = DynamicLossScaler(scale=1024.0, growth_interval=2)
    for p in params:
        p.grad = torch.ones_like(p) * 1024.0
    assert scaler.unscale(params).item() == 0
    assert torch.equal(params[0].grad, torch.ones(2)), "unscale divides by the scale"
    if mesh.pp_rank == 0 and mesh.tp_rank == 1:
        params[1].grad[0] = float("nan")
    assert scaler.unscale(params).item() == 1, "an injected overflow on one rank skips the step on all"
    scaler.update(finite=False)
    assert scaler.scale == 512.0 and scaler.clean_steps == 0
    for _ in range(2):
        scaler.update(finite=True)
    assert scaler.scale == 1024.0, "growth after growth_interval clean steps"
    restored = DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored == scaler


def test_global_norm_counts_each_element_once_and_overflow_is_agreed():
    spawn(grad_checks, 4, timeout=300)


@pytest.mark.tier("unit")
def test_loss_scaler_rejects_bad_settings():
    with pytest.raises(ValueError, match="growth_factor=1.0"):
        DynamicLossScaler(growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor=1.5"):
        DynamicLossScaler(backoff_factor=1.5)
