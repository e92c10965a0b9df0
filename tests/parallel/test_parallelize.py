"""``ShardingPlan`` and ``parallelize``: a plan is checked as data, applied by module path, and says every
parameter's facts; misuse names the path and the fix. At tp 2 (one 2-rank spawn): the block library's
``Attention`` with its plan (``ParallelAttention``) equals the plain one, and the facts follow the
sequence-parallel region (inside it a parameter the plan does not name is a partial sum over tp; below a
``gather``, and for ``scatter``, whole)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpzoo.kernels import modules as kernel_modules
from tpzoo.models import Attention, ParallelAttention, RotaryEmbedding
from tpzoo.parallel import ParallelPlan, ShardingPlan, facts, init_mesh, parallelize
from tpzoo.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tpzoo.parallel.random import TPRandom
from tpzoo.sharding_plan import matches, prefixed
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("unit")




@pytest.mark.parametrize("styles, message", [
    ({"a.b": "colwise"}, "sharding plan: 'a.b' has style 'colwise'; the styles are column, grouped_qkv, row"),
    ({"a..b": "row"}, "sharding plan: 'a..b' is not a dotted module path"),
], ids=["unknown-style", "empty-component"])
def test_plan_is_checked_as_data(styles, message):
    with pytest.raises(ValueError, match=message):
        ShardingPlan(styles)


def test_patterns_match_whole_paths_one_star_a_component():
    plan = ShardingPlan({"layers.*.mlp.fc": "column", **prefixed("head", {"out": "vocab_output"})})
    assert plan.style_of("layers.3.mlp.fc") == "column" and plan.style_of("head.out") == "vocab_output"
    assert plan.style_of("layers.3.mlp.fc.weight") is None and plan.style_of("layers.mlp.fc") is None
    assert matches("*.x", "a.x") and not matches("*.x", "a.b.x")
    merged = plan | ShardingPlan({"layers.*.mlp.fc": "row"}, ("ffn_hidden_size",))
    assert merged.style_of("layers.0.mlp.fc") == "row" and merged.tp_divides == ("ffn_hidden_size",)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.fc matches 2 patterns \(layers\.\*\.mlp\.fc, "
                                         r"layers\.0\.\*\.fc\); keep one"):
        ShardingPlan({"layers.*.mlp.fc": "column", "layers.0.*.fc": "row"}).style_of("layers.0.mlp.fc")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.act = nn.GELU(approximate="tanh")
        self.drop = nn.Dropout(0.1)
        self.gamma = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x + self.gamma * self.drop(self.down(self.act(self.up(self.norm(x)))))


PLAN = ShardingPlan({"up": "column", "down": "row", "norm": "norm"})


def test_parallelize_swaps_in_parallel_layers_and_kernels_keeping_the_parameters():
    block = Block()
    norm_weight = block.norm.weight
    out = parallelize(block, ParallelPlan(init_mesh(), kernels="torch"), PLAN)
    assert isinstance(out.up, ColumnParallelLinear) and isinstance(out.down, RowParallelLinear)
    assert isinstance(out.norm, kernel_modules.LayerNorm) and out.norm.weight is norm_weight
    assert isinstance(out.act, kernel_modules.GELU) and out.act.kernels == "torch" and out.act.approximate == "tanh"
    assert isinstance(out.drop, nn.Dropout)  # no sequence parallelism: replicated activations, the default stream
    assert facts(out.up.weight).tp_split_dim == 0 and facts(out.down.weight).tp_split_dim == 1
    assert not facts(out.gamma).tp_partial and not facts(out.norm.weight).tp_partial
    assert sorted(dict(out.named_parameters())) == sorted(dict(Block().named_parameters()))


@pytest.mark.parametrize("styles, error, message", [
    ({"norm": "column"}, TypeError,
     "norm: the sharding plan styles it 'column', which takes an nn.Linear, got LayerNorm"),
    ({"up": "partial", "up.weight": "replicated"}, ValueError, "up.weight lies inside up"),
    ({"gamma": "column"}, ValueError, "parameter gamma has style 'column'; a parameter takes partial or replicated"),
    ({"down": "vocab_output"}, TypeError, "down: 'vocab_output' takes a module without parameters"),
    ({"emb": "vocab"}, TypeError, r"emb: 'vocab' splits a plain nn.Embedding lookup, but this one has padding_idx=0"),
], ids=["column-of-a-norm", "styled-twice", "parameter-style", "vocab-output-of-a-linear", "embedding-padding-idx"])
def test_parallelize_refuses_a_plan_that_does_not_fit(styles, error, message):
    block = Block()
    block.emb = nn.Embedding(16, 8, padding_idx=0)  # its padding row's gradient would not stay zero once split
    with pytest.raises(error, match=message):
        parallelize(block, init_mesh(), ShardingPlan(styles))


def _at_tp2() -> dict[str, object]:
    mesh = init_mesh(tp=2)
    torch.manual_seed(0)
    rotary = RotaryEmbedding(8, 10000.0, 16, fraction=0.5)
    plain = Attention(32, 4, num_query_groups=2, rotary=rotary, qk_norm="RMSNorm")
    torch.manual_seed(0)
    split = ParallelAttention(32, 4, ParallelPlan(mesh, sequence_parallel=True), num_query_groups=2,
                              rotary=RotaryEmbedding(8, 10000.0, 16, fraction=0.5), qk_norm="RMSNorm")
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    shard = x.chunk(2, dim=1)[mesh.tp_rank]
    out = {"max error": (split(shard) - plain(x).chunk(2, dim=1)[mesh.tp_rank]).abs().max().item(),
           "q_norm partial": facts(split.q_norm.weight).tp_partial,
           "core wrapped": isinstance(split.core_attention, TPRandom)}
    block = parallelize(Block(), ParallelPlan(mesh, sequence_parallel=True), PLAN | ShardingPlan({"down": "gather"}))
    out["in region"] = {n: facts(p).tp_partial for n, p in block.named_parameters() if facts(p).tp_split_dim is None}
    out["dropout"] = type(block.drop).__name__
    heads = nn.Module()  # a heads module with a parameter of its own stays itself; its dropout draws per rank
    heads.core = nn.Module()
    heads.core.tau, heads.core.drop = nn.Parameter(torch.ones(1)), nn.Dropout(0.1)
    heads = parallelize(heads, ParallelPlan(mesh), ShardingPlan({"core": "heads"}))
    out["heads dropout"] = (type(heads.core).__name__, type(heads.core.drop).__name__, facts(heads.core.tau).tp_partial)
    return out


@pytest.mark.tier("distributed")
def test_parallel_attention_and_the_sequence_parallel_region_at_tp2():
    for found in spawn(_at_tp2, 2):
        assert found["max error"] < 1e-5 and found["q_norm partial"] and found["core wrapped"], found
        # gamma and the norm meet sequence shards: partial; "down" (kept whole here) sits below its own gather: whole
        assert found["in region"] == {"norm.weight": True, "norm.bias": True, "down.weight": False, "down.bias": False,
                                      "gamma": True}
        assert found["dropout"] == "TPRandom"
        assert found["heads dropout"] == ("Module", "TPRandom", True), found["heads dropout"]
