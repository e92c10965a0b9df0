"""The Llama-like adapters: Hugging Face <-> tpzoo for Llama (``families.GQA_LM``: 2 kv heads, untied
output; ``GQA_LM_TIED_MHA``: multi-head, tied; ``SCALED_ROPE_LM``: Llama 3.x's rotary scaling), Qwen2
(``QKV_BIAS_LM``), Qwen3 (``QK_NORM_LM``), Mistral (``WINDOW_LM``, a window shorter than the prompt), Mixtral
(``MOE_LM``, mixtures of experts) and Qwen2-MoE (``SHARED_MOE_LM``, with a gated shared expert; both in the ranks'
checks, and each its own exact round trip of the experts' saved layout):
exact state-dict round trips, by the library and by ``python -m tpzoo.convert`` (its main); the
configs tpzoo refuses; and on 4 gloo ranks (one spawn, each check its own case, see ``cases``) logits
(both attention backends), loss and greedy generation equal Hugging Face's at tp 1, 2 and 4, where tp
4 of 2 kv heads is refused (kv heads are split across tp ranks, never replicated), the mixtures of experts' logits
also with their experts split over ep 2 (at tp 1 and 2), and each family's trait is read from the Hugging Face
config and needed for that equality.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cases import CaseLog, assert_case
from families import (GQA_LM, GQA_LM_TIED_MHA, HF_VOCAB, MOE_LM, QK_NORM_LM, QKV_BIAS_LM, SCALED_ROPE_LM,
                      SHARED_MOE_LM, WINDOW, WINDOW_LM, hf_class, hf_config, hf_model)
from hf_models import mean_loss

from tpzoo.convert import ConversionError, from_hf, hf_to_tpzoo, read_hf, to_hf, tpzoo_to_hf
from tpzoo.convert.hf import saved_layout
from tpzoo.convert.__main__ import main as convert_main
from tpzoo.models.attention import CoreAttention
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("unit")

VARIANTS = {"gqa": GQA_LM, "tied-mha": GQA_LM_TIED_MHA, "llama3": SCALED_ROPE_LM, "qwen2": QKV_BIAS_LM,
            "qwen3": QK_NORM_LM, "mistral": WINDOW_LM}
# the ranks' checks: the dense variants, Mixtral's mixtures of experts and Qwen2-MoE's with a shared expert
SPAWNED = {**VARIANTS, "moe": MOE_LM, "shared-moe": SHARED_MOE_LM}
EXPERT_TPS = {"moe": (1, 2), "shared-moe": (1, 2)}  # the tp of each ep 2 check of a mixture of experts
# each mixture-of-experts family's saved layout: the case, the layer's block, each expert's gate, up and down names
MOE_LAYOUTS = {"mixtral": (MOE_LM, "block_sparse_moe", ("w1", "w3", "w2")),
               "qwen2_moe": (SHARED_MOE_LM, "mlp", ("gate_proj", "up_proj", "down_proj"))}
TPS = (1, 2, 4)
ATTENTION = ("sdpa", "fused-softmax")
B, S, PROMPT, NEW = 2, 12, 5, 7
HEADS = 4
assert PROMPT > WINDOW, "the Mistral case's window must be shorter than the prompt it continues"


def kv_heads(variant: str) -> int:
    return SPAWNED[variant].hf["num_key_value_heads"]


def refused(variant: str, tp: int) -> bool:
    return kv_heads(variant) % tp != 0


def case_names() -> list[str]:
    """Every check of ``decoder_checks``, in the order it runs them."""
    names = []
    for v in SPAWNED:
        names += [f"{v}-tp{tp}-refused" if refused(v, tp) else f"{v}-tp{tp}-{a}" for tp in TPS
                  for a in (ATTENTION[:1] if refused(v, tp) else ATTENTION)]
        names += [f"{v}-tp{tp}-ep2" for tp in EXPERT_TPS.get(v, ())]
        names += [f"{v}-trait"] * (v in TRAITS) + [f"{v}-generate-tp{tp}" for tp in (1, 2)] + [f"{v}-to-hf-tp2"]
    return names


# ------------------------------------------------------------------------------- one process

@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dict_round_trips_exactly_with_groups_laid_out(variant):
    case = VARIANTS[variant]
    hf = hf_model(case)
    original, g, tied = hf.state_dict(), kv_heads(variant), case.hf["tie_word_embeddings"]
    class_name, options, config, state = hf_to_tpzoo(hf.config, original, case.architecture)
    assert (class_name, options, config.model_type) == (case.model, {}, case.family)
    assert (config.rotary_base, config.layernorm_epsilon, config.num_query_groups, config.ffn_hidden_size,
            config.max_position_embeddings, config.tie_word_embeddings) == (500.0, 1e-4, g, 96, 32, tied)
    assert config.head_dim == case.hf.get("head_dim", 64 // HEADS)
    h, d, per = "model.layers.1.", config.head_dim, HEADS // g
    fused = ["weight", "bias"] if config.add_qkv_bias else ["weight"]
    for p in fused:  # group j: its query heads, then k_j, then v_j, d rows each
        q, k, v = (original[f"{h}self_attn.{x}_proj.{p}"] for x in "qkv")
        qkv = state[f"layers.1.self_attention.query_key_value.{p}"]
        for j in range(g):
            block = qkv[(per + 2) * d * j: (per + 2) * d * (j + 1)]
            expected = torch.cat([q[per * d * j: per * d * (j + 1)], k[d * j: d * (j + 1)], v[d * j: d * (j + 1)]])
            assert torch.equal(block, expected), f"{p} of group {j}"
    up_gate = state["layers.1.mlp.dense_h_to_4h.weight"]
    assert torch.equal(up_gate[0::2], original[f"{h}mlp.gate_proj.weight"])
    assert torch.equal(up_gate[1::2], original[f"{h}mlp.up_proj.weight"])
    assert ("head.output_layer.weight" in state) == (not tied)
    for x in "qk" if config.qk_layernorm else "":
        assert torch.equal(state[f"layers.1.self_attention.{x}_norm.weight"], original[f"{h}self_attn.{x}_norm.weight"])

    back_config, back, tied_names = tpzoo_to_hf(class_name, options, config, state)
    assert back.keys() == original.keys(), sorted(set(back) ^ set(original))
    for key in original:
        assert torch.equal(back[key], original[key]), f"{key} changed"
    assert tied_names == ({"lm_head.weight"} if tied else set())
    assert hf_to_tpzoo(back_config, back)[2] == config
    assert (back_config.architectures, back_config.num_key_value_heads, back_config.rms_norm_eps,
            back_config.tie_word_embeddings) == ([case.architecture], g, 1e-4, tied)


@pytest.mark.parametrize("family", MOE_LAYOUTS)
def test_moe_state_dict_round_trips_exactly_with_experts_stacked(family):
    """A mixture-of-experts family's checkpoint layout (each expert's gate, up and down; the router ``gate``;
    Qwen2-MoE's shared expert and its gate) <-> the stacked experts, gate and up rows interleaved; the model object's
    weights read in that layout too (transformers 5 holds the experts stacked in memory)."""
    case, block, (gate, up, down) = MOE_LAYOUTS[family]
    hf = hf_model(case)
    original = saved_layout(hf)
    class_name, options, config, state = hf_to_tpzoo(hf.config, original, case.architecture)
    width = case.hf.get("moe_intermediate_size", case.hf["intermediate_size"])
    assert (class_name, config.num_experts, config.moe_router_topk, config.expert_ffn_size) == (case.model, 4, 2, width)
    h = f"model.layers.1.{block}."
    experts = state["layers.1.mlp.experts.dense_h_to_4h"]
    assert experts.shape == (4, 2 * width, 64)
    assert torch.equal(state["layers.1.mlp.router.weight"], original[f"{h}gate.weight"])
    for e in range(4):
        assert torch.equal(experts[e, 0::2], original[f"{h}experts.{e}.{gate}.weight"])
        assert torch.equal(experts[e, 1::2], original[f"{h}experts.{e}.{up}.weight"])
        assert torch.equal(state["layers.1.mlp.experts.dense_4h_to_h"][e], original[f"{h}experts.{e}.{down}.weight"])
    if "shared_expert_intermediate_size" in case.hf:
        shared = state["layers.1.mlp.shared_expert.dense_h_to_4h.weight"]
        assert shared.shape == (2 * case.hf["shared_expert_intermediate_size"], 64)
        assert torch.equal(shared[0::2], original[f"{h}shared_expert.gate_proj.weight"])
        assert torch.equal(shared[1::2], original[f"{h}shared_expert.up_proj.weight"])
        assert torch.equal(state["layers.1.mlp.shared_expert_gate.weight"], original[f"{h}shared_expert_gate.weight"])
        assert config.norm_topk_prob is False and config.add_qkv_bias
    back_config, back, _ = tpzoo_to_hf(class_name, options, config, state)
    assert back.keys() == original.keys(), sorted(set(back) ^ set(original))
    assert all(torch.equal(back[key], original[key]) for key in original)
    assert hf_to_tpzoo(back_config, back)[2] == config
    assert back_config.num_experts_per_tok == 2


# each family's trait as read from its Hugging Face config (``drop_trait`` takes it out: the logits change)
TRAITS = {"llama3": dict(rope_scaling=True, rope_scaling_factor=8.0, rope_original_max_positions=16),
          "qwen2": dict(add_qkv_bias=True), "qwen3": dict(qk_layernorm=True, kv_channels=24),
          "mistral": dict(window_size=WINDOW)}


def drop_trait(variant: str, attention: torch.nn.Module) -> None:
    """Take the family's trait out of one layer's attention."""
    if variant == "llama3":
        rotary = attention.rotary
        attention.rotary = type(rotary)(rotary.head_dim, rotary.base, rotary.max_positions)
    elif variant == "qwen2":
        assert attention.dense.bias is None, "Qwen2's output projection has no bias"
        attention.query_key_value.bias.data.zero_()
    elif variant == "qwen3":
        attention.q_norm = None
    else:  # the core attention, inside its tp RNG wrapper
        next(m for m in attention.modules() if isinstance(m, CoreAttention)).window = None


REFUSED = {
    "attention_bias": (dict(attention_bias=True), "attention_bias=True"),
    "mlp_bias": (dict(mlp_bias=True), "mlp_bias=True"),
    "rope_scaling": (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), r"rope_scaling=.*'linear'"),
    "hidden_act": (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    "yarn": (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), r"rope_scaling=.*'yarn'.*llama3"),
}


@pytest.mark.parametrize("setting", REFUSED)
def test_llama_config_tpzoo_cannot_represent_is_refused(setting):
    change, message = REFUSED[setting]
    config = hf_config(GQA_LM, **change)
    with pytest.raises(ConversionError, match=f"unsupported Hugging Face config: {message}"):
        hf_to_tpzoo(config, {}, GQA_LM.architecture)


def chat_tokenizer(vocab_size: int):
    """A small byte-level BPE ``PreTrainedTokenizerFast`` with a chat template, as a hub folder holds one."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>"])
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran to the park"] * 10, trainer)
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>{% endfor %}"
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=template)


def test_llama_command_line_round_trip(tmp_path, capsys):
    """``python -m tpzoo.convert from-hf`` then ``to-hf``, run as the command's ``main`` in this process
    (test_convert runs ``python -m`` itself). The folder's tokenizer travels both ways, chat template included."""
    from transformers import AutoTokenizer

    from tpzoo.data.demo import DEMO_TOKENIZER

    hf = hf_model(GQA_LM, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "hf")  # leaves out the tied lm_head.weight
    chat_tokenizer(hf.config.vocab_size).save_pretrained(tmp_path / "hf")
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "tz")]) == 0
    assert convert_main(["to-hf", str(tmp_path / "tz"), str(tmp_path / "hf2")]) == 0
    out = capsys.readouterr().out
    assert f"wrote tpzoo {GQA_LM.model}" in out and f"wrote Hugging Face {GQA_LM.architecture}" in out, out
    assert out.count("with its tokenizer (tokenizer.json, tokenizer_config.json") == 2, out
    before, after = (AutoTokenizer.from_pretrained(tmp_path / name) for name in ("hf", "hf2"))
    chat = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"}]
    assert after.apply_chat_template(chat, tokenize=False) == before.apply_chat_template(chat, tokenize=False)
    assert after.encode("a dog sat") == before.encode("a dog sat") and after.eos_token == "<|endoftext|>"
    assert convert_main(["to-hf", str(tmp_path / "tz"), str(tmp_path / "hf2"), "--overwrite"]) == 0  # not empty
    with pytest.raises(SystemExit, match="0"):
        convert_main(["--help"])
    with pytest.raises(SystemExit, match="2"):  # the demo tokenizer's 512 tokens do not fit the model's 101
        convert_main(["to-hf", str(tmp_path / "tz"), str(tmp_path / "hf3"), "--tokenizer-model", str(DEMO_TOKENIZER)])
    assert "has 512 tokens but the model's vocabulary has 101; pass the --tokenizer-model" in capsys.readouterr().err
    back = hf_class(GQA_LM).from_pretrained(tmp_path / "hf2").state_dict()
    original = hf.state_dict()
    assert back.keys() == original.keys()
    for key in original:
        assert torch.equal(back[key], original[key]), f"{key} changed"


# ------------------------------------------------------------------------------- 4 gloo ranks

def hf_greedy(hf: torch.nn.Module, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """Hugging Face's greedy continuation, the whole sequence recomputed each step (no cache)."""
    out = prompt
    for _ in range(new):
        out = torch.cat([out, hf(out).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return out


def decoder_checks(tmp: str, ids: torch.Tensor, expected: dict[str, dict[str, torch.Tensor]]) -> CaseLog:
    """On each rank: each variant's Hugging Face folder (``tmp``/variant) through ``from_hf`` at tp 1, 2, 4 with
    each attention backend against Hugging Face's ``expected`` logits and loss, and greedy tokens; ``to_hf`` at tp 2
    against that folder's weights. The ranks never build a transformers model (its import alone costs seconds)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tpzoo.generate import generate

    log = CaseLog()
    meshes = {tp: init_mesh(tp=tp) for tp in TPS}
    expert_meshes = {tp: init_mesh(tp=tp, ep=2) for tp in (1, 2)}  # the 4 / tp dp ranks in groups of 2
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    for variant in SPAWNED:
        folder, ref, models = Path(tmp) / variant, expected[variant], {}
        for tp in TPS:
            if refused(variant, tp):
                with log.case(f"{variant}-tp{tp}-refused"):
                    kv = kv_heads(variant)
                    with pytest.raises(ValueError, match=f"num_query_groups={kv} is not divisible by the "
                                                         f"tensor-parallel size tp={tp}"):
                        from_hf(folder, meshes[tp])
                continue
            for attention in ATTENTION:
                with log.case(f"{variant}-tp{tp}-{attention}"):
                    plan = ParallelPlan(meshes[tp], attention_backend=attention, kernels="torch")
                    model = from_hf(folder, plan).eval()
                    models.setdefault(tp, model)
                    with torch.no_grad():
                        log.check(model(ids), ref["logits"], f"tp={tp} {attention} logits", "logits")
                        log.check(mean_loss(model(ids, labels=labels), labels), ref["loss"],
                                  f"tp={tp} {attention} loss", "loss")
        for tp in EXPERT_TPS.get(variant, ()):  # each rank's experts half of them, its tokens sent over ep
            with log.case(f"{variant}-tp{tp}-ep2"):
                model = from_hf(folder, ParallelPlan(expert_meshes[tp], kernels="torch")).eval()
                with torch.no_grad():
                    log.check(model(ids), ref["logits"], f"tp={tp} ep=2 logits", "logits")
        if variant in TRAITS:  # the config holds the family's trait; without it the logits are not Hugging Face's
            with log.case(f"{variant}-trait"):
                model = from_hf(folder, meshes[1]).eval()
                assert {k: getattr(model.config, k) for k in TRAITS[variant]} == TRAITS[variant]
                for layer in model.layers.values():
                    drop_trait(variant, layer.self_attention)
                with torch.no_grad():
                    gap = (model(ids) - ref["logits"]).abs().max()
                assert gap > 1e-3 * ref["logits"].abs().max(), f"{variant}: the trait changes nothing"
        for tp in (1, 2):  # greedy with tpzoo's KV cache: the same tokens as Hugging Face's, at each tp
            with log.case(f"{variant}-generate-tp{tp}"):
                out = generate(models[tp], ids[:, :PROMPT], NEW)
                assert torch.equal(out, ref["greedy"]), f"tp={tp}: {out.tolist()} != HF {ref['greedy'].tolist()}"
        with log.case(f"{variant}-to-hf-tp2"):
            out = to_hf(models[2], Path(tmp) / f"{variant}-back")
            if dist.get_rank() == 0:  # the file save_pretrained wrote (tied repeats left out) and ours
                back, original = load_file(str(out / "model.safetensors")), load_file(str(folder / "model.safetensors"))
                assert back.keys() == original.keys(), sorted(set(back) ^ set(original))
                for key in original:
                    assert torch.equal(back[key], original[key]), f"to_hf(from_hf(m)) at tp=2 changed {key}"
                assert hf_to_tpzoo(*read_hf(out))[2] == models[2].config
    return log


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> list[CaseLog]:
    tmp = tmp_path_factory.mktemp("decoders")
    ids = torch.randint(0, HF_VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    expected = {}
    for variant, case in SPAWNED.items():
        hf = hf_model(case)
        hf.save_pretrained(tmp / variant)
        with torch.no_grad():
            out = hf(ids, labels=ids)
            expected[variant] = dict(logits=out.logits, loss=out.loss, greedy=hf_greedy(hf, ids[:, :PROMPT], NEW))
    out = spawn(decoder_checks, 4, str(tmp), ids, expected)
    print("max relative errors:", {k: f"{max(o.max.get(k, 0) for o in out):.2e}" for k in out[0].max})
    return out


@pytest.mark.tier("distributed")
def test_decoders_every_check_has_a_case(logs):
    assert logs[0].ran == case_names()


@pytest.mark.tier("distributed")
@pytest.mark.parametrize("name", case_names())
def test_decoders_match_hugging_face(logs, name):
    assert_case(logs, name)
