"""Every model case of ``families.CASES`` at tp = 1, 2, 4 equals the tp=1 model, GPT-2 and BERT equal
Hugging Face (4 gloo ranks, one spawn; each check is its own test case, see ``cases``).

Every rank builds the tp=1 reference (on a tp=1 mesh) next to the tensor-parallel model, feeds
both the same batch and compares logits, losses and every parameter's gathered gradient.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from cases import CaseLog, assert_case
from families import CASES, CAUSAL_LM, GQA_LM, MAIN, MASKED_LM, MASKED_LM_ONLY, Case, batch, without_labels

from tpzoo.models import full_grads, full_state_dict, num_parameters
from tpzoo.models.pretrained import from_pretrained, save_pretrained
from tpzoo.parallel import ParallelPlan, facts, init_mesh, manual_seed, sync_sequence_parallel_grads
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")



B, S, VOCAB = 2, 8, 101
TOL = 1e-5
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=VOCAB,
            max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
TPS = (1, 2, 4)
# the Triton kernels (interpreted: seconds a check) for each mix of them: layernorm and a causal or padding mask,
# RMSNorm with rotary, RMSNorm on the heads' q and k, the sliding-window mask (bert-cls and qwen2 add a head or biases)
TRITON = ("gpt", "bert", "llama", "qwen3", "mistral")
ATTENTION = ("fused-softmax", "sdpa")


def config_of(case: Case, **changes):
    extra = {"num_labels": 3} if case.inputs == "classification" else {}
    return case.config(**{**TINY, **extra, **changes})


def inputs(case: Case, s: int = S) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, s), generator=g)
    ids[0, :2] = torch.tensor([0, VOCAB - 1])
    return batch(case, ids, g)


def run(model, kwargs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Outputs of one forward without and one with its labels (``model.label_keys``), then the gathered
    gradients of sum(logits * a fixed random probe) + sum(every loss)."""
    logits = model(**without_labels(kwargs))
    losses = model(**without_labels(kwargs), **{k: kwargs[k] for k in model.label_keys})
    losses = losses if isinstance(losses, tuple) else (losses,)
    probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    total = (logits * probe).sum() + sum(loss.sum() for loss in losses)
    model.zero_grad(set_to_none=True)
    total.backward()
    sync_sequence_parallel_grads(model, model.mesh.tp_group)
    out = {"logits": logits.detach(), **{f"loss {i}": loss.detach() for i, loss in enumerate(losses)}}
    return {**out, **{f"grad {n}": g for n, g in full_grads(model).items()}}


def check_against_tp1(log: CaseLog, ref_mesh, mesh, refs: dict, name: str, s: int = S, num_layers: int = 2,
                      **options) -> None:
    """The case at this mesh's tp with plan ``options`` equals the tp=1 torch-kernel, sdpa, no-SP model."""
    case = CASES[name]
    config, x = config_of(case, num_layers=num_layers), inputs(case, s)
    key = (name, num_layers, s)
    if key not in refs:
        ref = case.build(config, ParallelPlan(ref_mesh, kernels="torch", attention_backend="sdpa"))
        refs[key] = (full_state_dict(ref), run(ref, x))
    ref_state, expected = refs[key]
    model = case.build(config, ParallelPlan(mesh, **options))
    state = full_state_dict(model)
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state), \
        "weights differ from the tp=1 model's"
    got = run(model, x)
    assert got.keys() == expected.keys(), f"outputs/gradients {sorted(set(got) ^ set(expected))} missing"
    for what in expected:  # a gradient that sums terms of both signs can be small: judged against 0.1 then
        log.close(got[what], expected[what], what, "tp vs tp=1", TOL, scale=0.1 if what.startswith("grad") else 1e-30)


def check_stages(mesh, name: str) -> None:
    """Two pipeline stages built apart hold the whole model's weights and compose to its output."""
    case = CASES[name]
    config, x = config_of(case), without_labels(inputs(case))
    whole = case.build(config, mesh).eval()
    first = case.build(config, mesh, post_process=False, layers=range(0, 1)).eval()
    last = case.build(config, mesh, pre_process=False, layers=[1]).eval()
    tied = [n for m in (whole, first, last) for n, p in m.named_parameters() if facts(p).pp_tied]
    ties = config.tie_word_embeddings and whole.ties_output_to_embedding
    expected = ["embedding.word_embeddings.weight", "head.word_embeddings.weight"] if ties else []
    assert tied == expected, tied
    whole_state = whole.state_dict()
    for stage in (first, last):
        for key, t in stage.state_dict().items():
            source = "embedding.word_embeddings.weight" if key == "head.word_embeddings.weight" else key
            assert torch.equal(t, whole_state[source]), f"stage: {key} differs from the whole model's"
    extras = {k: v for k, v in x.items() if k != "input_ids"}
    with torch.no_grad():
        staged, full = last(first(x["input_ids"], **extras), **extras), whole(**x)
    assert torch.equal(staged, full), "stages do not compose to the whole model"
    assert first.boundary_shape(B, S) == (B, S, config.hidden_size)


def check_recompute(mesh, name: str) -> None:
    """With dropout on, recomputing activations gives the very same outputs and gradients."""
    case = CASES[name]
    config, x = config_of(case, hidden_dropout=0.2, attention_dropout=0.2), inputs(case)
    results = []
    for recompute in (False, True):
        plan = ParallelPlan(mesh, sequence_parallel=True, attention_backend="fused-softmax",
                            recompute_activations=recompute)
        model = case.build(config, plan)
        manual_seed(7, mesh)
        results.append(run(model, x))
    for what in results[0]:
        assert torch.equal(results[0][what], results[1][what]), f"recompute changed {what}"
    with torch.no_grad():
        assert not torch.equal(results[0]["logits"], model.eval()(**without_labels(x))), "dropout is off"


def check_parameter_count(mesh, name: str) -> None:
    """The full tpzoo model holds exactly num_parameters(config) parameters (no vocabulary padding)."""
    case = CASES[name]
    config = config_of(case)
    n = sum(t.numel() for t in full_state_dict(case.build(config, mesh)).values())
    assert n == num_parameters(config, case.head), f"{n} parameters, num_parameters says " \
                                                   f"{num_parameters(config, case.head)}"


def check_reshard(tmp: Path) -> None:
    """A model saved at tp=2 loads at tp=4 (tp=1 where 4 does not split the kv heads), whole and as a last
    pipeline stage, with the same weights."""
    for name in MAIN:
        case = CASES[name]
        model = case.build(config_of(case), init_mesh(tp=2))
        saved = full_state_dict(model)
        save_pretrained(model, tmp / name)
        mesh = init_mesh(tp=4 if fits(name, 4) else 1)
        loaded = from_pretrained(tmp / name, mesh)
        assert type(loaded) is type(model) and loaded.mesh.tp_size == mesh.tp_size
        state = full_state_dict(loaded)
        assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved), \
            f"{name}: a tp=2 save loads differently at tp={mesh.tp_size}"
        last = from_pretrained(tmp / name, mesh, pre_process=False, layers=[1])
        for key, t in full_state_dict(last).items():
            source = "embedding.word_embeddings.weight" if key == "head.word_embeddings.weight" else key
            assert torch.equal(t, saved[source]), f"{name}: last stage loads {key} differently"


def hf_inputs() -> dict[str, torch.Tensor]:
    """The batch of ``hf_models.check_hf``: ids, padding mask, token types, MLM / next-token / class labels."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, S - S // 4:] = 0
    types = (torch.arange(S) >= S // 2).long().expand(B, S).clone()
    mlm = torch.full((B, S), -100)
    mlm[:, 1::3] = ids[:, 1::3]
    return dict(ids=ids, mask=mask, types=types, mlm=mlm, next=torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1),
                cls=torch.tensor([0, 2]))


def check_binary_loss(mesh) -> None:
    """The masked LM given next_sentence_label: (per-token MLM loss, per-sequence cross entropy of the binary
    logits, 0 where ignored); a label of the wrong shape raises naming the sizes."""
    x = hf_inputs()
    model = MASKED_LM.build(config_of(MASKED_LM), mesh).eval()
    y = torch.tensor([1, -100])
    mlm, nsp = model(x["ids"], x["types"], x["mask"], labels=x["mlm"], next_sentence_label=y)
    _, logits = model(x["ids"], x["types"], x["mask"], return_binary_logits=True)
    assert torch.equal(mlm, model(x["ids"], x["types"], x["mask"], labels=x["mlm"]))
    expected = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    assert nsp.shape == (2,) and nsp[1] == 0 and torch.allclose(nsp, expected, rtol=1e-6, atol=0), (nsp, expected)
    with pytest.raises(ValueError, match=r"next_sentence_label must be \[b\] = \[2\] .* got \(1,\)"):
        model(x["ids"], labels=x["mlm"], next_sentence_label=y[:1])


def check_misuse(mesh) -> None:
    """At tp=4: sizes tp cannot split, and inputs the model cannot take, raise errors naming the numbers."""
    causal, masked, gqa = CAUSAL_LM, MASKED_LM_ONLY, GQA_LM
    with pytest.raises(ValueError, match="num_attention_heads=2 is not divisible by the tensor-parallel size tp=4"):
        causal.build(config_of(causal, num_attention_heads=2), mesh)
    with pytest.raises(ValueError, match="ffn_hidden_size=66 is not divisible by the tensor-parallel size tp=4"):
        causal.build(config_of(causal, ffn_hidden_size=66), mesh)
    with pytest.raises(ValueError, match="num_query_groups=2 is not divisible by the tensor-parallel size tp=4"):
        gqa.build(config_of(gqa), mesh)
    with pytest.raises(ValueError, match=r"layers must be consecutive layer numbers within 0\.\.1 "
                                         r"\(num_layers=2\), got \[1, 2\]"):
        causal.build(config_of(causal), mesh, layers=range(1, 3))
    with pytest.raises(ValueError, match=f"needs a config with model_type='{causal.family}', "
                                         f"got model_type='{masked.family}'"):
        causal.build(config_of(masked), mesh)
    with pytest.raises(TypeError, match=f"{gqa.model} takes a {type(config_of(gqa)).__name__}, got "
                                        f"{type(config_of(causal)).__name__}"):
        gqa.build(config_of(causal), mesh)
    model = causal.build(config_of(causal), ParallelPlan(mesh, sequence_parallel=True))
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by tp=4"):
        model(torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence length 20 exceeds max_position_embeddings=16"):
        model(torch.zeros(1, 20, dtype=torch.long))
    model = masked.build(config_of(masked, attention_dropout=0.1), mesh)
    with pytest.raises(KeyError, match="RNG stream 'tp' was never added"):  # dropout needs manual_seed first
        model(torch.zeros(1, 4, dtype=torch.long))
    model.eval()
    with pytest.raises(ValueError, match=f"needs a {masked.model} built with add_binary_head=True"):
        model(torch.zeros(1, 4, dtype=torch.long), return_binary_logits=True)
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, seq\]"):
        model(torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(4))


def fits(name: str, tp: int) -> bool:
    """Whether tp splits the case's kv heads (Llama's 2 kv heads do not split over tp=4: rejected)."""
    return getattr(config_of(CASES[name]), "query_groups", tp) % tp == 0


def check_rejected(mesh, name: str) -> None:
    with pytest.raises(ValueError, match=f"is not divisible by the tensor-parallel size tp={mesh.tp_size}"):
        CASES[name].build(config_of(CASES[name]), mesh)


def case_names() -> list[str]:
    """Every check of ``all_model_checks``, in the order it runs them."""
    names = []
    for tp in TPS:
        names += [f"{name}-tp{tp}-rejected" for name in CASES if not fits(name, tp)]
        names += [f"{name}-tp{tp}-{'sp-' if sp else ''}{attention}" for name in CASES if fits(name, tp)
                  for sp in ((False, True) if tp > 1 else (False,)) for attention in ATTENTION]
        names += [f"{name}-tp{tp}-triton-{attention}" for name in TRITON if fits(name, tp) for attention in ATTENTION]
        names += [f"{name}-tp{tp}-stages" for name in MAIN if fits(name, tp)]
        names += [f"hf-tp{tp}"] if tp < 4 else []
    return (names + [f"{name}-recompute" for name in MAIN] + ["reshard"] + [f"{n}-parameters" for n in CASES]
            + [f"{MASKED_LM.name}-binary-loss", "misuse"])


def all_model_checks(tmp: str) -> CaseLog:
    from hf_models import check_hf  # imports transformers: kept out of the module import

    log, refs, ref_mesh = CaseLog(), {}, init_mesh(tp=1)
    for tp in TPS:
        mesh = init_mesh(tp=tp)
        for name in [n for n in CASES if not fits(n, tp)]:
            with log.case(f"{name}-tp{tp}-rejected"):
                check_rejected(mesh, name)
        for name in [n for n in CASES if fits(n, tp)]:
            for sp in (False, True) if tp > 1 else (False,):
                for attention in ATTENTION:
                    with log.case(f"{name}-tp{tp}-{'sp-' if sp else ''}{attention}"):
                        check_against_tp1(log, ref_mesh, mesh, refs, name, sequence_parallel=sp,
                                          attention_backend=attention, kernels="torch")
        for name in [n for n in TRITON if fits(n, tp)]:  # the Triton kernels through the interpreter: 1 layer, 4 tokens
            for attention in ATTENTION:
                with log.case(f"{name}-tp{tp}-triton-{attention}"):
                    check_against_tp1(log, ref_mesh, mesh, refs, name, s=4, num_layers=1, sequence_parallel=tp > 1,
                                      attention_backend=attention, kernels="triton")
        for name in [n for n in MAIN if fits(n, tp)]:
            with log.case(f"{name}-tp{tp}-stages"):
                check_stages(mesh, name)
        if tp < 4:
            with log.case(f"hf-tp{tp}"):
                check_hf(log, mesh, hf_inputs(), Path(tmp) / f"tp{tp}")
    for name in MAIN:
        with log.case(f"{name}-recompute"):
            check_recompute(init_mesh(tp=2), name)
    with log.case("reshard"):
        check_reshard(Path(tmp))
    for name in CASES:
        with log.case(f"{name}-parameters"):
            check_parameter_count(init_mesh(tp=2), name)
    with log.case(f"{MASKED_LM.name}-binary-loss"):
        check_binary_loss(init_mesh(tp=4))
    with log.case("misuse"):
        check_misuse(init_mesh(tp=4))
    return log


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> list[CaseLog]:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    out = spawn(all_model_checks, 4, str(tmp_path_factory.mktemp("models")), timeout=900)
    print("max relative errors:", {k: f"{max(o.max.get(k, 0) for o in out):.2e}" for k in out[0].max})
    return out


def test_every_check_has_a_case(logs):
    assert logs[0].ran == case_names()


@pytest.mark.parametrize("name", case_names())
def test_model_matches(logs, name):
    assert_case(logs, name)
