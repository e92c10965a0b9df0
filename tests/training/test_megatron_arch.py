"""Megatron-LM's architecture and speed flags (tpzoo.training.architecture_args): the families they
describe, the config fields they set, the attention backend and kernels they choose, and the
recompute they ask for (the same loss and gradients as none, the layers rerun as the method says).
Unit tests in this process (a world-1 mesh); their misuse is in tests/misuse_cases.py."""

from __future__ import annotations

import functools

import pytest
import torch

from families import (CASES, CAUSAL_LM, GQA_LM, MASKED_LM, MOE_LM, PRETRAIN_DEFAULT, QK_NORM_LM, QKV_BIAS_LM,
                      SHARED_MOE_LM, WINDOW_LM,
                      batch)
from pretrain_helpers import script

from tpzoo.models.attention import CoreAttention
from tpzoo.models.presets import get_preset
from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed
from tpzoo.training.architecture_args import resolve_architecture, resolve_speed
from tpzoo.training.model_args import ModelChoice, model_config
from tpzoo.training.optimizer_args import TrainDefaults, fill_schedule_defaults
from tpzoo.training.run_config import RunConfig

pytestmark = pytest.mark.tier("unit")



pretrain = script("pretrain")

# Megatron-LM's Llama launch line's architecture flags, and its GPT-3 example's (their defaults spelled out)
LLAMA = ("--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
         "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2")
GPT = "--position-embedding-type learned_absolute --normalization LayerNorm --add-bias-linear"
SIZES = dict(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=100,
             max_position_embeddings=16, hidden_dropout=0.1, attention_dropout=0.1)
RECOMPUTE = {"per-layer": dict(recompute_activations=True),
             "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
             "full-block-2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
             "selective": dict(recompute_granularity="selective")}
# forward runs of each of the 3 layers, and of layer 0's core attention, in one training step
RUNS = {"none": ([1, 1, 1], 1), "per-layer": ([2, 2, 2], 2), "full-uniform-2": ([2, 2, 2], 2),
        "full-block-2": ([2, 2, 1], 2), "selective": ([1, 1, 1], 2)}


def resolved(line: str, script_model: str = PRETRAIN_DEFAULT.family):
    """pretrain.py's flags of ``line`` (``script_model``: the script's default family), resolved."""
    args = pretrain.parser(model=script_model).parse_args(line.split())
    resolve_architecture(args)
    resolve_speed(args)
    return args


def built(args, vocab_size: int):
    return model_config(ModelChoice.of(vars(args)), vocab_size=vocab_size)


@pytest.mark.parametrize("case, line, script", [
    (GQA_LM.name, LLAMA, CAUSAL_LM.family), (GQA_LM.name, f"--model {GQA_LM.family} {LLAMA}", CAUSAL_LM.family),
    (CAUSAL_LM.name, GPT, CAUSAL_LM.family), (CAUSAL_LM.name, "", CAUSAL_LM.family),
    (MASKED_LM.name, GPT, MASKED_LM.family)])
def test_megatron_architecture_flags_build_the_family_preset(case, line, script):
    """The flags pick the family they describe (the script's default among the causal and the masked LM's,
    as pretrain_gpt.py and pretrain_bert.py have) and build its preset."""
    preset = CASES[case].config()
    args = resolved(line, script)
    assert args.model == preset.model_type
    assert built(args, preset.vocab_size) == preset


def test_megatron_architecture_flags_set_config_fields():
    gqa = GQA_LM.config()
    args = resolved(f"{LLAMA} --norm-epsilon 1e-6 --rotary-base 500000 --make-vocab-size-divisible-by 7 "
                    f"--kv-channels 32 --rotary-percent 1.0 --attention-softmax-in-fp32")
    assert built(args, 512) == gqa.replace(layernorm_epsilon=1e-6, rotary_base=500000.0,
                                           make_vocab_size_divisible_by=7)
    # described by the flags, Megatron-LM's meaning: tied unless untied, one kv head per head unless grouped
    plain = built(resolved(LLAMA.replace(" --untie-embeddings-and-output-weights", "").split(" --group")[0]), 512)
    assert plain == gqa.replace(tie_word_embeddings=True, num_query_groups=None)
    grouped = resolved(f"--model {GQA_LM.family} --group-query-attention")
    assert built(grouped, 512).num_query_groups == 1  # Megatron's default
    assert built(resolved(f"--model {GQA_LM.family}"), 512) == gqa  # --model alone: the preset, as before


@pytest.mark.parametrize("flags, case, fields", [
    ("--add-qkv-bias", QKV_BIAS_LM, dict(add_qkv_bias=True)),
    ("--qk-layernorm --kv-channels 48", QK_NORM_LM, dict(qk_layernorm=True, kv_channels=48)),
    ("--window-size 4095,0", WINDOW_LM, dict(window_size=4096)),
    ("--use-rope-scaling --rope-scaling-factor 32", GQA_LM, dict(rope_scaling=True, rope_scaling_factor=32.0)),
    ("--num-experts 8 --moe-router-topk 2", MOE_LM, dict(num_experts=8, moe_router_topk=2)),
    ("--num-experts 8 --moe-router-topk 2 --add-qkv-bias --moe-shared-expert-intermediate-size 64", SHARED_MOE_LM,
     dict(num_experts=8, add_qkv_bias=True, moe_shared_expert_intermediate_size=64))])
def test_megatron_flags_of_todays_decoders_pick_and_build_their_family(flags, case, fields):
    """Megatron-LM's Llama line with Qwen2's, Qwen3's, Mistral's or Llama 3.x's flag describes that family (no
    --model) and sets its fields; with --model the same; a window is Megatron-LM's LEFT,0 = LEFT + 1 keys."""
    for line in (f"{LLAMA} {flags}", f"--model {case.family} {LLAMA} {flags}"):
        args = resolved(line)
        config = built(args, 512)
        assert args.model == case.family and {k: getattr(config, k) for k in fields} == fields, line
    head = CASES[case.name].config().head_dim
    assert built(resolved(f"--model {GQA_LM.family} --kv-channels 64"), 512).head_dim == 64 != head


@pytest.mark.parametrize("line, message", [
    (f"--model {GQA_LM.family} --add-qkv-bias", "--model llama disagrees with the architecture flags: --add-qkv-bias "
                                                "(llama: no --add-qkv-bias); drop those flags or pass --model qwen2"),
    (f"{LLAMA} --qk-layernorm --window-size 15,0", "no model family has the architecture these flags describe"),
    (f"--model {CAUSAL_LM.family} --use-rope-scaling", "--use-rope-scaling applies to rotary positions, but --model gpt "
                                                       "has learned_absolute ones; drop it"),
    (f"--model {CAUSAL_LM.family} --rope-scaling-factor 4", "--rope-scaling-factor does not apply to --model gpt"),
    (f"--model {CAUSAL_LM.family} --kv-channels 16", "gpt's heads have hidden size / heads"),
    (f"--model {GQA_LM.family} --num-experts 8", "--model llama disagrees with the architecture flags: --num-experts 8 "
                                                 "(llama: no --num-experts); drop those flags or pass --model mixtral"),
    (f"{GPT} --num-experts 8", "no model family has the architecture these flags describe; the nearest")])
def test_megatron_flags_of_todays_decoders_refuse_families_without_the_trait(line, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        built(resolved(line), 512)


@pytest.mark.parametrize("value", ["4096,1", "x", "1,2,3", "4096,-1"])
def test_window_size_takes_megatron_left_and_zero(value, capsys):
    with pytest.raises(SystemExit) as e:
        pretrain.parser(model=CAUSAL_LM.family).parse_args(["--window-size", value])
    assert e.value.code == 2
    assert "--window-size: expected LEFT" in capsys.readouterr().err


def test_make_vocab_size_divisible_by_pads_the_vocabulary():
    """V' = V rounded up to a multiple of m x tp (tp 1 here; tp 2 in tests/checkpoint/test_checkpoint_flags.py)."""
    case = CAUSAL_LM
    for multiple, rows in ((128, 128), (7, 105), (1, 100)):
        model = case.build(case.config(**SIZES, make_vocab_size_divisible_by=multiple), init_mesh())
        assert model.embedding.word_embeddings.weight.shape[0] == rows, multiple
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by must be >= 1, got 0"):
        get_preset(case.preset, make_vocab_size_divisible_by=0)


@pytest.mark.parametrize("line, backend, kernels", [
    ("--use-flash-attn", "sdpa", "auto"), ("--attention-backend flash", "sdpa", "auto"),
    ("--attention-backend fused", "sdpa", "auto"),
    ("--attention-backend local", "fused-softmax", "auto"), ("--attention-backend unfused", "fused-softmax", "auto"),
    ("--attention-backend auto --no-masked-softmax-fusion", "auto", "torch"),
    ("--no-bias-gelu-fusion", "auto", "torch"),
    ("--no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm --overlap-grad-reduce "
     "--no-bias-swiglu-fusion --no-gradient-accumulation-fusion", "auto", "auto")])
def test_megatron_speed_flags_choose_tpzoo_backends(line, backend, kernels):
    args = resolved(line)
    assert (args.attention_backend, args.kernels) == (backend, kernels)


def test_recompute_flags_reach_the_plan():
    args = resolved("--recompute-granularity full --recompute-method block --recompute-num-layers 2")
    plan = RunConfig.of(vars(fill_schedule_defaults(args, TrainDefaults()))).plan(init_mesh())
    assert (plan.recompute_granularity, plan.recompute_method, plan.recompute_num_layers) == ("full", "block", 2)
    assert plan.recompute_units(3) == [(0, 1, True), (1, 2, True), (2, 3, False)]
    assert plan.replace(recompute_method="uniform").recompute_units(5) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert ParallelPlan(init_mesh(), recompute_activations=True).recompute_units(2) == [(0, 1, True), (1, 2, True)]
    with pytest.raises(ValueError, match="--recompute-granularity full needs --recompute-method"):
        ParallelPlan(init_mesh(), recompute_granularity="full")


def train_step(model, case, counts: dict) -> dict[str, torch.Tensor]:
    """Loss and local gradients of one forward and backward; ``counts``: forward runs per layer and of
    layer 0's core attention."""
    model.train()
    for i, layer in model.layers.items():
        layer.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts.get(i, 0) + 1))
    core = next(m for m in model.layers["0"].self_attention.modules() if isinstance(m, CoreAttention))  # the plan
    core.register_forward_pre_hook(lambda *_: counts.__setitem__("core", counts.get("core", 0) + 1))  # wraps it
    g = torch.Generator().manual_seed(0)
    kwargs = batch(case, torch.randint(0, SIZES["vocab_size"], (2, 8), generator=g), g)
    manual_seed(7, model.mesh)
    loss = model(**kwargs).sum()
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}


@functools.cache
def recomputed(name: str, method: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``train_step`` of the family case ``name`` under the plan of ``method`` ("none": no recompute)."""
    case, counts = CASES[name], {}
    plan = ParallelPlan(init_mesh(), kernels="torch", attention_backend="fused-softmax", **RECOMPUTE.get(method, {}))
    return train_step(case.build(case.config(**SIZES), plan), case, counts), counts


@pytest.mark.parametrize("name", [CAUSAL_LM.name, GQA_LM.name])
@pytest.mark.parametrize("method", ["none", *RECOMPUTE])
def test_recompute_gives_the_same_loss_and_gradients(name, method):
    """With dropout on, each recompute reruns the layers it says and changes no loss or gradient bit."""
    (reference, _), (results, counts) = recomputed(name, "none"), recomputed(name, method)
    for key, value in reference.items():
        assert torch.equal(value, results[key]), f"{method} changed {key}"
    assert ([counts[str(i)] for i in range(3)], counts["core"]) == RUNS[method]
