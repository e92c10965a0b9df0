"""Tensor-parallel layers equal their dense PyTorch counterparts at tp = 1, 2, 4 (4 gloo ranks, one spawn)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpzoo.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    facts,
    init_method_normal,
    init_mesh,
    manual_seed,
    padded_vocab_size,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from tpzoo.parallel.collectives import all_gather, all_reduce, gather_from_sequence_parallel_region, split
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")



B, S, IN, OUT = 2, 8, 12, 20
TOL = 1e-5


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = TOL) -> None:
    """max |actual - expected| <= tol * max |expected| (float32 results against dense float32)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= tol * max(scale, 1e-30), f"{what}: max error {err:.3g} over scale {scale:.3g} exceeds {tol}"


def seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_column(tp_group, tp: int, rank: int, gather_output: bool, sequence_parallel: bool) -> None:
    torch.manual_seed(1)
    layer = ColumnParallelLinear(IN, OUT, gather_output=gather_output, sequence_parallel=sequence_parallel,
                                 tp_group=tp_group)
    full_b = seeded(2, OUT)
    with torch.no_grad():
        layer.bias.copy_(split(full_b, 0, tp_group))
    dense = nn.Linear(IN, OUT)
    with torch.no_grad():
        dense.weight.copy_(all_gather(layer.weight.detach(), 0, tp_group))
        dense.bias.copy_(full_b)
    x, dy = seeded(3, B, S, IN), seeded(4, B, S, OUT)
    x_dense = x.clone().requires_grad_()
    y_dense = dense(x_dense)
    y_dense.backward(dy)

    x_tp = (split(x, 1, tp_group) if sequence_parallel else x).clone().requires_grad_()
    y = layer(x_tp)
    tag = f"column tp={tp} gather={gather_output} sp={sequence_parallel}"
    if gather_output:
        assert_rel(y, y_dense, f"{tag} output")
        y.backward(dy)
    else:
        assert_rel(y, split(y_dense, 2, tp_group), f"{tag} output")
        y.backward(split(dy, 2, tp_group))
    expected_dx = split(x_dense.grad, 1, tp_group) if sequence_parallel else x_dense.grad
    assert_rel(x_tp.grad, expected_dx, f"{tag} input grad")
    assert_rel(all_gather(layer.weight.grad, 0, tp_group), dense.weight.grad, f"{tag} weight grad")
    assert_rel(all_gather(layer.bias.grad, 0, tp_group), dense.bias.grad, f"{tag} bias grad")
    assert (facts(layer.weight).tp_split_dim, facts(layer.bias).tp_split_dim) == (0, 0)
    if not gather_output:
        layer.skip_bias_add = True
        y_nobias, bias = layer(x_tp.detach())
        assert bias is layer.bias
        assert_rel(y_nobias + bias, y.detach(), f"{tag} skip_bias_add")


def check_row(tp_group, tp: int, input_is_parallel: bool, sequence_parallel: bool) -> None:
    torch.manual_seed(5)
    layer = RowParallelLinear(IN, OUT, input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                              tp_group=tp_group)
    full_b = seeded(6, OUT)
    with torch.no_grad():
        layer.bias.copy_(full_b)
    dense = nn.Linear(IN, OUT)
    with torch.no_grad():
        dense.weight.copy_(all_gather(layer.weight.detach(), 1, tp_group))
        dense.bias.copy_(full_b)
    x, dy = seeded(7, B, S, IN), seeded(8, B, S, OUT)
    x_dense = x.clone().requires_grad_()
    y_dense = dense(x_dense)
    y_dense.backward(dy)

    x_tp = (split(x, 2, tp_group) if input_is_parallel else x).clone().requires_grad_()
    y = layer(x_tp)
    tag = f"row tp={tp} input_is_parallel={input_is_parallel} sp={sequence_parallel}"
    if sequence_parallel:
        assert_rel(y, split(y_dense, 1, tp_group), f"{tag} output")
        y.backward(split(dy, 1, tp_group))
        sync_sequence_parallel_grads(layer, tp_group)
    else:
        assert_rel(y, y_dense, f"{tag} output")
        y.backward(dy)
    expected_dx = split(x_dense.grad, 2, tp_group) if input_is_parallel else x_dense.grad
    assert_rel(x_tp.grad, expected_dx, f"{tag} input grad")
    assert_rel(all_gather(layer.weight.grad, 1, tp_group), dense.weight.grad, f"{tag} weight grad")
    assert_rel(layer.bias.grad, dense.bias.grad, f"{tag} bias grad")
    assert facts(layer.weight).tp_split_dim == 1 and facts(layer.bias).tp_split_dim is None, "row bias is replicated"
    layer.skip_bias_add = True
    y_nobias, bias = layer(x_tp.detach())
    assert_rel(y_nobias + bias, y.detach(), f"{tag} skip_bias_add")


def check_embedding(tp_group, tp: int, vocab: int, sequence_parallel: bool) -> None:
    torch.manual_seed(9)
    layer = VocabParallelEmbedding(vocab, IN, pad_vocab_to_multiple_of=4, sequence_parallel=sequence_parallel,
                                   tp_group=tp_group)
    full_w = all_gather(layer.weight.detach(), 0, tp_group)
    assert full_w.shape[0] == padded_vocab_size(vocab, tp, 4)
    assert not full_w[vocab:].any(), "padding rows must be zero"
    assert facts(layer.weight).tp_split_dim == 0
    dense = nn.Embedding(vocab, IN)
    with torch.no_grad():
        dense.weight.copy_(full_w[:vocab])
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(10))
    ids[0, :3] = torch.tensor([0, vocab - 1, vocab // 2])
    dy = seeded(11, B, S, IN)
    dense(ids).backward(dy)
    y_dense = dense(ids).detach()

    y = layer(ids)
    tag = f"embedding tp={tp} vocab={vocab} sp={sequence_parallel}"
    if sequence_parallel:
        assert_rel(y, split(y_dense, 1, tp_group), f"{tag} output")
        y.backward(split(dy, 1, tp_group))
    else:
        assert_rel(y, y_dense, f"{tag} output")
        y.backward(dy)
    grad = all_gather(layer.weight.grad, 0, tp_group)
    assert_rel(grad[:vocab], dense.weight.grad, f"{tag} weight grad")
    assert not grad[vocab:].any(), f"{tag}: padding rows got gradient"


def check_cross_entropy(tp_group, tp: int, vocab: int, label_smoothing: float, ignore_index: int) -> None:
    padded = padded_vocab_size(vocab, tp, 4)
    full = seeded(12, B, S, padded) * 3
    target = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(13))
    target[0, :2] = torch.tensor([vocab - 1, 0])
    target[1, 1::3] = ignore_index
    dl = seeded(14, B, S)
    ref_logits = full[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.transpose(1, 2), target, reduction="none", ignore_index=ignore_index,
                          label_smoothing=label_smoothing)
    ref.backward(dl)
    ref_grad = F.pad(ref_logits.grad, (0, padded - vocab))

    local = split(full, 2, tp_group).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, label_smoothing=label_smoothing, ignore_index=ignore_index,
                                        vocab_size=vocab, tp_group=tp_group)
    tag = f"cross entropy tp={tp} vocab={vocab} smoothing={label_smoothing} ignore={ignore_index}"
    assert loss.dtype == torch.float32
    assert_rel(loss, ref.detach(), f"{tag} loss")
    assert (loss[target == ignore_index] == 0).all(), f"{tag}: ignored targets contribute"
    loss.backward(dl)
    assert_rel(local.grad, split(ref_grad, 2, tp_group), f"{tag} logits grad")


def check_sequence_gather_backward(tp_group, tp: int) -> None:
    """gather_from_sequence_parallel_region: reduce-scatter backward for partial grads, split for full ones."""
    x, dy = seeded(15, B, S // tp, IN), seeded(16, B, S, IN)
    rank_dy = dy * (1 + dist.get_rank(tp_group))  # a different partial gradient on every tp rank
    for tp_output_grad, grad, expected in ((True, rank_dy, split(all_reduce(rank_dy, tp_group), 1, tp_group)),
                                           (False, dy, split(dy, 1, tp_group))):
        x_local = x.clone().requires_grad_()
        y = gather_from_sequence_parallel_region(x_local, tp_group, tensor_parallel_output_grad=tp_output_grad)
        assert_rel(y, all_gather(x, 1, tp_group), f"sequence gather tp={tp} output")
        y.backward(grad)
        assert_rel(x_local.grad, expected, f"sequence gather tp={tp} tp_output_grad={tp_output_grad} grad")


def check_same_full_weights(tp_group, tp: int) -> None:
    """The same seed gives the same gathered weights at every tp: the dense N(0, 0.02^2) draw."""
    for cls, shape, dim in ((ColumnParallelLinear, (OUT, IN), 0), (RowParallelLinear, (OUT, IN), 1)):
        torch.manual_seed(21)
        layer = cls(IN, OUT, tp_group=tp_group)
        torch.manual_seed(21)
        expected = init_method_normal()(torch.empty(shape))
        assert torch.equal(all_gather(layer.weight.detach(), dim, tp_group), expected), f"{cls.__name__} tp={tp}"
    torch.manual_seed(21)
    emb = VocabParallelEmbedding(37, IN, tp_group=tp_group)
    torch.manual_seed(21)
    expected = init_method_normal()(torch.empty(37, IN))
    assert torch.equal(all_gather(emb.weight.detach(), 0, tp_group)[:37], expected), f"embedding tp={tp}"


def check_misuse(tp_group) -> None:
    """At tp=4: sizes that tp does not divide and wrong inputs raise errors that name the numbers."""
    with pytest.raises(ValueError, match="out_features=6 is not divisible by the tensor-parallel size tp=4"):
        ColumnParallelLinear(8, 6, tp_group=tp_group)
    with pytest.raises(ValueError, match="in_features=10 is not divisible by the tensor-parallel size tp=4"):
        RowParallelLinear(10, 8, tp_group=tp_group)
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel=True, tp_group=tp_group)
    with pytest.raises(ValueError, match="gather_output=True with skip_bias_add=True"):
        ColumnParallelLinear(8, 8, gather_output=True, skip_bias_add=True, tp_group=tp_group)
    col = ColumnParallelLinear(8, 8, tp_group=tp_group)
    with pytest.raises(ValueError, match=r"expects inputs \[\.\.\., 8\] on each tp rank, got \(2, 3, 7\)"):
        col(torch.zeros(2, 3, 7))
    row = RowParallelLinear(8, 8, tp_group=tp_group)
    with pytest.raises(ValueError, match=r"expects inputs \[\.\.\., 2\] on each tp rank, got \(2, 3, 8\)"):
        row(torch.zeros(2, 3, 8))
    sp = ColumnParallelLinear(8, 8, sequence_parallel=True, tp_group=tp_group)
    with pytest.raises(ValueError, match="has size 6, which the tensor-parallel size 4 does not divide"):
        RowParallelLinear(8, 8, sequence_parallel=True, tp_group=tp_group)(torch.zeros(2, 6, 2))
    del sp
    emb = VocabParallelEmbedding(10, 4, tp_group=tp_group)
    with pytest.raises(RuntimeError, match=r"token ids must lie in \[0, 10\)"):  # a device-side assertion
        emb(torch.tensor([[1, 10, 12]]))
    with pytest.raises(TypeError, match="int32/int64 ids"):
        emb(torch.zeros(2, 2))
    logits = torch.zeros(2, 3, 4)
    with pytest.raises(RuntimeError, match=r"targets must lie in \[0, 16\) or equal ignore_index=-100"):
        vocab_parallel_cross_entropy(logits, torch.tensor([[0, 16, -100], [1, 2, 3]]), tp_group=tp_group)
    with pytest.raises(ValueError, match=r"logits \(2, 3, 4\) and target \(2, 4\) disagree"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long), tp_group=tp_group)
    with pytest.raises(ValueError, match=r"vocab_size=17 must lie in \[1, 16\]"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), vocab_size=17, tp_group=tp_group)


def check_rng_streams(mesh) -> None:
    """Dropout under fork("tp") differs across tp ranks; the default stream agrees and is left untouched; a
    nested fork draws on from where the outer one stands."""
    manual_seed(1234, mesh)
    with mesh.rng.fork():
        tp_mask = F.dropout(torch.ones(64), 0.5)
    default_mask = F.dropout(torch.ones(64), 0.5)
    with mesh.rng.fork():
        assert not torch.equal(F.dropout(torch.ones(64), 0.5), tp_mask), "tp stream did not advance"
    manual_seed(1234, mesh)
    assert torch.equal(F.dropout(torch.ones(64), 0.5), default_mask), "fork() disturbed the default stream"
    tp_masks = all_gather(tp_mask[None], 0, mesh.tp_group)
    default_masks = all_gather(default_mask[None], 0, mesh.tp_group)
    assert all(torch.equal(m, default_masks[0]) for m in default_masks), "default stream differs across tp"
    assert len({tuple(m.tolist()) for m in tp_masks}) == mesh.tp_size, "tp stream repeats across tp ranks"
    manual_seed(1234, mesh)
    with mesh.rng.fork():  # a fork inside a fork of the same stream (a dropout in a module run in it) runs on
        outer = F.dropout(torch.ones(64), 0.5)
        with mesh.rng.fork():
            inner = F.dropout(torch.ones(64), 0.5)
    assert torch.equal(F.dropout(torch.ones(64), 0.5), default_mask), "a nested fork disturbed the default stream"
    manual_seed(1234, mesh)
    with mesh.rng.fork():
        assert torch.equal(F.dropout(torch.ones(64), 0.5), outer) and torch.equal(F.dropout(torch.ones(64), 0.5), inner)


def check_mesh_layout() -> None:
    """Ranks are row-major over (pp, dp, tp): tp peers adjacent, as the mesh docstring draws; with ep, the ep groups
    consecutive dp ranks, the edp groups those at the same place in them."""
    for tp, pp in ((2, 1), (2, 2), (1, 2), (4, 1)):
        mesh = init_mesh(tp=tp, pp=pp)
        world = dist.get_world_size()
        dp = world // (tp * pp)
        rank = dist.get_rank()
        pp_rank, dp_rank, tp_rank = rank // (dp * tp), rank // tp % dp, rank % tp
        assert (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) == (pp_rank, dp_rank, tp_rank), mesh
        assert (mesh.pp_size, mesh.dp_size, mesh.tp_size) == (pp, dp, tp), mesh
        base = pp_rank * dp * tp + dp_rank * tp
        assert dist.get_process_group_ranks(mesh.tp_group) == list(range(base, base + tp))
        assert dist.get_process_group_ranks(mesh.dp_group) == [pp_rank * dp * tp + d * tp + tp_rank for d in range(dp)]
        assert dist.get_process_group_ranks(mesh.pp_group) == [p * dp * tp + dp_rank * tp + tp_rank for p in range(pp)]
    for tp, ep in ((1, 2), (1, 4), (2, 2)):  # ep carved out of dp: groups of ep consecutive dp ranks
        mesh = init_mesh(tp=tp, ep=ep)
        dp, rank = mesh.dp_size, dist.get_rank()
        d, t = mesh.dp_rank, mesh.tp_rank
        assert mesh.ep_size == ep and mesh.ep_rank == d % ep, mesh
        first = d - d % ep
        assert dist.get_process_group_ranks(mesh.ep_group) == [(first + e) * tp + t for e in range(ep)]
        assert dist.get_process_group_ranks(mesh.edp_group) == [(g * ep + d % ep) * tp + t for g in range(dp // ep)]
        assert mesh.tp_ep_mesh.mesh.tolist() == [[(first + e) * tp + j for e in range(ep)] for j in range(tp)], rank
    with pytest.raises(ValueError, match="expert parallelism ep=3 must divide the data-parallel size dp=4"):
        init_mesh(ep=3)
    with pytest.raises(ValueError, match="world size 4 is not divisible by tp x pp = 3 x 1 = 3"):
        init_mesh(tp=3)
    with pytest.raises(ValueError, match=r"tp x pp x dp = 2 x 1 x 3 = 6 does not equal the world size 4"):
        init_mesh(tp=2, dp=3)


def all_layer_checks() -> int:
    check_mesh_layout()
    for tp in (1, 2, 4):
        mesh = init_mesh(tp=tp)
        g = mesh.tp_group
        check_same_full_weights(g, tp)
        check_rng_streams(mesh)
        check_sequence_gather_backward(g, tp)
        for gather_output in (False, True):
            for sp in (False, True):
                check_column(g, tp, mesh.tp_rank, gather_output, sp)
        for input_is_parallel, sp in ((True, False), (False, False), (True, True)):
            check_row(g, tp, input_is_parallel, sp)
        for vocab in (37, 5):
            for sp in (False, True):
                check_embedding(g, tp, vocab, sp)
            for smoothing, ignore_index in ((0.0, -100), (0.1, -100), (0.0, 3)):
                check_cross_entropy(g, tp, vocab, smoothing, ignore_index)
    check_misuse(init_mesh(tp=4).tp_group)
    return dist.get_rank()


def test_layers_match_dense_at_tp_1_2_4():
    assert spawn(all_layer_checks, 4, timeout=600) == [0, 1, 2, 3]
