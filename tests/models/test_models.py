"""GPT and BERT at tp = 1, 2, 4 equal the tp=1 model, and equal Hugging Face (4 gloo ranks, one spawn).

Every rank builds the tp=1 reference (on a tp=1 mesh) next to the tensor-parallel model, feeds
both the same batch and compares logits, losses and every parameter's gathered gradient.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tpzoo.models import (
    BertForSequenceClassification,
    BertModel,
    GPTModel,
    full_grads,
    full_state_dict,
    get_preset,
    num_parameters,
)
from tpzoo.models.pretrained import from_pretrained, save_pretrained
from tpzoo.parallel import init_mesh, manual_seed, sync_sequence_parallel_grads
from tpzoo.testing import spawn

B, S, VOCAB = 2, 8, 101
TOL = 1e-5
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=16,
            hidden_dropout=0.0, attention_dropout=0.0)
KINDS = {  # name -> (preset, model class, constructor options, head for num_parameters)
    "gpt": ("gpt-tiny", GPTModel, {}, "lm"),
    "gpt-untied": ("gpt-tiny", GPTModel, {}, "lm"),
    "bert": ("bert-tiny", BertModel, {}, "pretraining"),
    "bert-mlm": ("bert-tiny", BertModel, {"add_binary_head": False}, "mlm"),
    "bert-cls": ("bert-tiny", BertForSequenceClassification, {}, "classification"),
}


class Errors:
    """Asserts relative closeness and keeps the largest relative error seen per category."""

    def __init__(self) -> None:
        self.max: dict[str, float] = {}

    def check(self, actual: torch.Tensor, expected: torch.Tensor, what: str, category: str, tol: float = TOL) -> None:
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        err = (actual.double() - expected.double()).abs().max().item()
        rel = err / max(expected.double().abs().max().item(), 1e-30)
        self.max[category] = max(self.max.get(category, 0.0), rel)
        assert rel <= tol, f"{what}: relative error {rel:.3g} exceeds {tol}"


def config_of(kind: str, **changes):
    preset = KINDS[kind][0]
    return get_preset(preset, **{**TINY, "tie_word_embeddings": kind != "gpt-untied", "num_labels": 3, **changes})


def build(kind: str, config, mesh, **stage):
    _, cls, options, _ = KINDS[kind]
    return cls(config, mesh, **options, **stage)


def batch(s: int = S) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, s), generator=g)
    ids[0, :2] = torch.tensor([0, VOCAB - 1])
    mask = torch.ones(B, s, dtype=torch.long)
    mask[1, s - s // 4:] = 0                                   # padding at the end of sample 1
    types = torch.zeros(B, s, dtype=torch.long)
    types[:, s // 2:] = 1
    mlm = torch.full((B, s), -100)
    mlm[:, 1::3] = ids[:, 1::3]
    return dict(ids=ids, mask=mask, types=types, mlm=mlm, next=torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1),
                cls=torch.tensor([0, 2])[:B], probe=torch.randn(B, s, VOCAB, generator=g),
                probe2=torch.randn(B, 3, generator=g))


def run(kind: str, model, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Outputs of one forward with and one without labels, then the gathered gradients of their sum."""
    if kind.startswith("gpt"):
        out = {"logits": model(x["ids"]), "loss": model(x["ids"], labels=x["next"])}
        total = (out["logits"] * x["probe"]).sum() + out["loss"].sum()
    elif kind == "bert-cls":
        out = {"logits": model(x["ids"], x["types"], x["mask"]),
               "loss": model(x["ids"], x["types"], x["mask"], labels=x["cls"])}
        total = (out["logits"] * x["probe2"]).sum() + out["loss"].sum()
    else:
        if kind == "bert":
            out = dict(zip(("logits", "binary"), model(x["ids"], x["types"], x["mask"], return_binary_logits=True)))
        else:
            out = {"logits": model(x["ids"], x["types"], x["mask"])}
        out["loss"] = model(x["ids"], x["types"], x["mask"], labels=x["mlm"])
        total = (out["logits"] * x["probe"]).sum() + out["loss"].sum()
        total = total + (out["binary"] * x["probe2"][:, :2]).sum() if "binary" in out else total
    model.zero_grad(set_to_none=True)
    total.backward()
    sync_sequence_parallel_grads(model, model.mesh.tp_group)
    return {**{k: v.detach() for k, v in out.items()}, **{f"grad {n}": g for n, g in full_grads(model).items()}}


def check_against_tp1(errors: Errors, ref_mesh, mesh, refs: dict, kind: str, x, **changes) -> None:
    """The model with ``changes`` at this mesh's tp equals the tp=1 torch-kernel, sdpa, no-SP model."""
    config = config_of(kind, **changes)
    key = (kind, config.num_layers, x["ids"].shape[1])
    if key not in refs:
        ref_config = config.replace(sequence_parallel=False, kernels="torch", attention_backend="sdpa")
        ref = build(kind, ref_config, ref_mesh)
        refs[key] = (full_state_dict(ref), run(kind, ref, x))
    ref_state, expected = refs[key]
    model = build(kind, config, mesh)
    tag = f"{kind} tp={mesh.tp_size} {changes}"
    state = full_state_dict(model)
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state), \
        f"{tag}: weights differ from the tp=1 model's"
    got = run(kind, model, x)
    assert got.keys() == expected.keys(), f"{tag}: outputs/gradients {sorted(set(got) ^ set(expected))} missing"
    for name in expected:
        errors.check(got[name], expected[name], f"{tag} {name}", "tp vs tp=1")


def check_stages(mesh, x) -> None:
    """Two pipeline stages built apart hold the whole model's weights and compose to its output."""
    for kind in ("gpt", "bert"):
        config = config_of(kind)
        whole = build(kind, config, mesh).eval()
        first = build(kind, config, mesh, post_process=False, layers=range(0, 1)).eval()
        last = build(kind, config, mesh, pre_process=False, layers=[1]).eval()
        shared = [n for m in (whole, first, last) for n, p in m.named_parameters() if getattr(p, "pp_shared", False)]
        assert shared == ["embedding.word_embeddings.weight", "head.word_embeddings.weight"], shared
        whole_state = whole.state_dict()
        for stage in (first, last):
            for name, t in stage.state_dict().items():
                source = "embedding.word_embeddings.weight" if name == "head.word_embeddings.weight" else name
                assert torch.equal(t, whole_state[source]), f"{kind} stage: {name} differs from the whole model's"
        with torch.no_grad():
            if kind == "gpt":
                staged, full = last(first(x["ids"])), whole(x["ids"])
            else:
                extras = dict(token_type_ids=x["types"], attention_mask=x["mask"])
                staged, full = last(first(x["ids"], **extras), **extras), whole(x["ids"], **extras)
        assert torch.equal(staged, full), f"{kind}: stages do not compose to the whole model"


def logits_of(kind: str, model, x) -> torch.Tensor:
    return model(x["ids"]) if kind.startswith("gpt") else model(x["ids"], x["types"], x["mask"])


def check_recompute(mesh, x) -> None:
    """With dropout on, recomputing activations gives the very same outputs and gradients."""
    for kind in ("gpt", "bert"):
        results = []
        for recompute in (False, True):
            config = config_of(kind, hidden_dropout=0.2, attention_dropout=0.2, sequence_parallel=True,
                               attention_backend="fused-softmax", recompute_activations=recompute)
            model = build(kind, config, mesh)
            manual_seed(7, mesh)
            results.append(run(kind, model, x))
        for name in results[0]:
            assert torch.equal(results[0][name], results[1][name]), f"{kind}: recompute changed {name}"
        with torch.no_grad():
            assert not torch.equal(results[0]["logits"], logits_of(kind, model.eval(), x)), f"{kind}: dropout is off"


def check_binary_loss(mesh, x) -> None:
    """BertModel given next_sentence_label: (per-token MLM loss, per-sequence cross entropy of the binary
    logits, 0 where ignored); a label of the wrong shape raises naming the sizes."""
    model = BertModel(config_of("bert"), mesh, add_binary_head=True).eval()
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
    with pytest.raises(ValueError, match="num_attention_heads=2 is not divisible by the tensor-parallel size tp=4"):
        GPTModel(config_of("gpt", num_attention_heads=2), mesh)
    with pytest.raises(ValueError, match="ffn_hidden_size=66 is not divisible by the tensor-parallel size tp=4"):
        GPTModel(config_of("gpt", ffn_hidden_size=66), mesh)
    with pytest.raises(ValueError, match=r"layers must be consecutive layer numbers within 0\.\.1 "
                                         r"\(num_layers=2\), got \[1, 2\]"):
        GPTModel(config_of("gpt"), mesh, layers=range(1, 3))
    with pytest.raises(ValueError, match="needs a config with model_type='gpt', got model_type='bert'"):
        GPTModel(config_of("bert"), mesh)
    model = GPTModel(config_of("gpt", sequence_parallel=True), mesh)
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by tp=4"):
        model(torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence length 20 exceeds max_position_embeddings=16"):
        model(torch.zeros(1, 20, dtype=torch.long))
    bert = BertModel(config_of("bert", attention_dropout=0.1), mesh, add_binary_head=False)
    with pytest.raises(KeyError, match="RNG stream 'tp' was never added"):  # dropout needs manual_seed first
        bert(torch.zeros(1, 4, dtype=torch.long))
    bert.eval()
    with pytest.raises(ValueError, match="needs a BertModel built with add_binary_head=True"):
        bert(torch.zeros(1, 4, dtype=torch.long), return_binary_logits=True)
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, seq\]"):
        bert(torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(4))


def check_parameter_counts(mesh) -> None:
    """The full tpzoo model holds exactly num_parameters(config) parameters (no vocabulary padding)."""
    for kind, (_, _, _, head) in KINDS.items():
        config = config_of(kind)
        n = sum(t.numel() for t in full_state_dict(build(kind, config, mesh)).values())
        assert n == num_parameters(config, head), f"{kind}: {n} parameters, num_parameters says " \
                                                  f"{num_parameters(config, head)}"


def all_model_checks(tmp: str) -> dict[str, float]:
    from hf_models import check_hf  # imports transformers: kept out of the module import

    errors = Errors()
    ref_mesh = init_mesh(tp=1)
    refs: dict = {}
    x, x_short = batch(), batch(4)
    for tp in (1, 2, 4):
        mesh = init_mesh(tp=tp)
        for kind in KINDS:
            for sp in (False, True):
                for attention in ("fused-softmax", "sdpa"):
                    check_against_tp1(errors, ref_mesh, mesh, refs, kind, x, sequence_parallel=sp,
                                      attention_backend=attention, kernels="torch")
        for kind in ("gpt", "bert"):  # the Triton kernels through the interpreter: one layer, 4 tokens
            for attention in ("fused-softmax", "sdpa"):
                check_against_tp1(errors, ref_mesh, mesh, refs, kind, x_short, num_layers=1,
                                  sequence_parallel=tp > 1, attention_backend=attention, kernels="triton")
        check_stages(mesh, x)
        if tp < 4:
            check_hf(errors, mesh, x, Path(tmp) / f"tp{tp}")
    mesh = init_mesh(tp=2)
    check_recompute(mesh, x)
    model = GPTModel(config_of("gpt"), mesh)
    saved = full_state_dict(model)
    save_pretrained(model, Path(tmp) / "gpt")
    mesh = init_mesh(tp=4)
    loaded = from_pretrained(Path(tmp) / "gpt", mesh)
    assert type(loaded) is GPTModel and loaded.mesh.tp_size == 4
    state = full_state_dict(loaded)
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved), \
        "a tp=2 save loads differently at tp=4"
    last = from_pretrained(Path(tmp) / "gpt", mesh, pre_process=False, layers=[1])  # a last pipeline stage
    for name, t in full_state_dict(last).items():
        source = "embedding.word_embeddings.weight" if name == "head.word_embeddings.weight" else name
        assert torch.equal(t, saved[source]), f"last stage loads {name} differently"
    check_parameter_counts(mesh)
    check_binary_loss(mesh, x)
    check_misuse(mesh)
    return errors.max


def test_models_match_tp1_and_hugging_face(tmp_path):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    results = spawn(all_model_checks, 4, str(tmp_path), timeout=600)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    print("max relative errors:", {k: f"{v:.2e}" for k, v in worst.items()})
    assert set(worst) == {"tp vs tp=1", "tpzoo vs hf"}
