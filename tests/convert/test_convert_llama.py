"""The Llama adapter: Hugging Face <-> tpzoo for the grouped-query causal LM (``families.GQA_LM``: 2 kv
heads, untied output) and that family multi-head with a tied output (``GQA_LM_TIED_MHA``): exact
state-dict round trips, by the library and by ``python -m tpzoo.convert`` (its main); the configs tpzoo
refuses; and on 4 gloo ranks (one spawn, each check its own case, see ``cases``) logits, loss and greedy
generation equal Hugging Face's at tp 1, 2 and 4, where tp 4 of 2 kv heads is refused (kv heads are
split across tp ranks, never replicated).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cases import CaseLog, assert_case
from families import GQA_LM, GQA_LM_TIED_MHA, HF_VOCAB, hf_class, hf_config, hf_model
from hf_models import mean_loss

from tpzoo.convert import ConversionError, from_hf, hf_to_tpzoo, read_hf, to_hf, tpzoo_to_hf
from tpzoo.convert.__main__ import main as convert_main
from tpzoo.parallel import init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("unit")



VARIANTS = {"gqa": GQA_LM, "tied-mha": GQA_LM_TIED_MHA}
TPS = (1, 2, 4)
B, S, PROMPT, NEW = 2, 12, 5, 7
HEADS, D = 4, 64 // 4


def kv_heads(variant: str) -> int:
    return VARIANTS[variant].hf["num_key_value_heads"]


def refused(variant: str, tp: int) -> bool:
    return kv_heads(variant) % tp != 0


def case_names() -> list[str]:
    """Every check of ``llama_checks``, in the order it runs them."""
    names = []
    for v in VARIANTS:
        names += [f"{v}-tp{tp}{'-refused' if refused(v, tp) else ''}" for tp in TPS]
        names += [f"{v}-generate-tp{tp}" for tp in (1, 2)] + [f"{v}-to-hf-tp2"]
    return names


# ------------------------------------------------------------------------------- one process

@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_state_dict_round_trips_exactly_with_groups_laid_out(variant):
    case = VARIANTS[variant]
    hf = hf_model(case)
    original, g = hf.state_dict(), kv_heads(variant)
    class_name, options, config, state = hf_to_tpzoo(hf.config, original, case.architecture)
    assert (class_name, options) == (case.model, {})
    assert (config.rotary_base, config.layernorm_epsilon, config.num_query_groups, config.ffn_hidden_size,
            config.max_position_embeddings, config.tie_word_embeddings) == (500.0, 1e-4, g, 96, 32, variant != "gqa")
    h = "model.layers.1."
    q, k, v = (original[f"{h}self_attn.{x}_proj.weight"] for x in "qkv")
    qkv = state["layers.1.self_attention.query_key_value.weight"]
    per = HEADS // g
    for j in range(g):  # group j: its query heads, then k_j, then v_j, D rows each
        block = qkv[(per + 2) * D * j: (per + 2) * D * (j + 1)]
        expected = torch.cat([q[per * D * j: per * D * (j + 1)], k[D * j: D * (j + 1)], v[D * j: D * (j + 1)]])
        assert torch.equal(block, expected), f"group {j}"
    up_gate = state["layers.1.mlp.dense_h_to_4h.weight"]
    assert torch.equal(up_gate[0::2], original[f"{h}mlp.gate_proj.weight"])
    assert torch.equal(up_gate[1::2], original[f"{h}mlp.up_proj.weight"])
    assert ("head.output_layer.weight" in state) == (variant == "gqa")

    back_config, back, tied = tpzoo_to_hf(class_name, options, config, state)
    assert back.keys() == original.keys(), sorted(set(back) ^ set(original))
    for key in original:
        assert torch.equal(back[key], original[key]), f"{key} changed"
    assert tied == (set() if variant == "gqa" else {"lm_head.weight"})
    assert hf_to_tpzoo(back_config, back)[2] == config
    assert (back_config.architectures, back_config.num_key_value_heads, back_config.rms_norm_eps,
            back_config.tie_word_embeddings) == ([case.architecture], g, 1e-4, variant != "gqa")


REFUSED = {
    "attention_bias": (dict(attention_bias=True), "attention_bias=True"),
    "mlp_bias": (dict(mlp_bias=True), "mlp_bias=True"),
    "rope_scaling": (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), r"rope_scaling=.*'linear'"),
    "hidden_act": (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    "head_dim": (dict(head_dim=8), r"head_dim=8 \(tpzoo's is hidden_size / num_attention_heads = 16\)"),
}


@pytest.mark.parametrize("setting", REFUSED)
def test_llama_config_tpzoo_cannot_represent_is_refused(setting):
    change, message = REFUSED[setting]
    config = hf_config(GQA_LM, **change)
    with pytest.raises(ConversionError, match=f"unsupported Hugging Face config: {message}"):
        hf_to_tpzoo(config, {}, GQA_LM.architecture)


def test_llama_command_line_round_trip(tmp_path, capsys):
    """``python -m tpzoo.convert from-hf`` then ``to-hf``, run as the command's ``main`` in this process
    (test_convert runs ``python -m`` itself)."""
    hf = hf_model(GQA_LM, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "hf")  # leaves out the tied lm_head.weight
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "tz")]) == 0
    assert convert_main(["to-hf", str(tmp_path / "tz"), str(tmp_path / "hf2")]) == 0
    out = capsys.readouterr().out
    assert f"wrote tpzoo {GQA_LM.model}" in out and f"wrote Hugging Face {GQA_LM.architecture}" in out, out
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


def llama_checks(tmp: str, ids: torch.Tensor, expected: dict[str, dict[str, torch.Tensor]]) -> CaseLog:
    """On each rank: each variant's Hugging Face folder (``tmp``/variant) through ``from_hf`` at tp 1, 2, 4
    against Hugging Face's ``expected`` logits, loss and greedy tokens; ``to_hf`` at tp 2 against that
    folder's weights. The ranks never build a transformers model (its import alone costs seconds)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tpzoo.generate import generate

    log = CaseLog()
    meshes = {tp: init_mesh(tp=tp) for tp in TPS}
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    for variant in VARIANTS:
        folder, ref, models = Path(tmp) / variant, expected[variant], {}
        for tp in TPS:
            with log.case(f"{variant}-tp{tp}{'-refused' if refused(variant, tp) else ''}"):
                if refused(variant, tp):
                    kv = kv_heads(variant)
                    with pytest.raises(ValueError, match=f"num_query_groups={kv} is not divisible by the "
                                                         f"tensor-parallel size tp={tp}"):
                        from_hf(folder, meshes[tp])
                    continue
                models[tp] = model = from_hf(folder, meshes[tp]).eval()
                with torch.no_grad():
                    log.check(model(ids), ref["logits"], f"tp={tp} logits", "logits")
                    log.check(mean_loss(model(ids, labels=labels), labels), ref["loss"], f"tp={tp} loss", "loss")
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
    tmp = tmp_path_factory.mktemp("gqa")
    ids = torch.randint(0, HF_VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    expected = {}
    for variant, case in VARIANTS.items():
        hf = hf_model(case)
        hf.save_pretrained(tmp / variant)
        with torch.no_grad():
            out = hf(ids, labels=ids)
            expected[variant] = dict(logits=out.logits, loss=out.loss, greedy=hf_greedy(hf, ids[:, :PROMPT], NEW))
    out = spawn(llama_checks, 4, str(tmp), ids, expected)
    print("max relative errors:", {k: f"{max(o.max.get(k, 0) for o in out):.2e}" for k in out[0].max})
    return out


@pytest.mark.tier("distributed")
def test_llama_every_check_has_a_case(logs):
    assert logs[0].ran == case_names()


@pytest.mark.tier("distributed")
@pytest.mark.parametrize("name", case_names())
def test_llama_matches_hugging_face(logs, name):
    assert_case(logs, name)
