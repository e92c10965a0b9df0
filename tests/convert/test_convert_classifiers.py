"""The decoders as sequence classifiers (``SequenceClassifier``: the last real token's hidden state into
``score``), against Hugging Face's ``...ForSequenceClassification`` of each decoder family (tiny random
models, made here from each family's case in ``families``): exact state-dict round trips in one process,
the configs refused; and on 2 gloo ranks (one spawn, a named check each) logits and loss equal Hugging
Face's within 1e-5 at tp 1 and 2 on right-padded batches, and ``to_hf`` at tp 2 gives the weights back
bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cases import CaseLog, assert_case
from families import CASES, HF_VOCAB, Case, hf_config, randomize

from tpzoo.convert import ConversionError, from_hf, hf_to_tpzoo, read_hf, to_hf, tpzoo_to_hf
from tpzoo.convert.mapping import architecture_of
from tpzoo.models.families import family
from tpzoo.parallel import init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("unit")

# each decoder family's language-model case; its classifier has the same sizes and ``CLASSES`` classes
DECODERS = {name: CASES[name] for name in ("gpt", "llama", "qwen2", "qwen3", "mistral")}
CLASSES, PAD, B, S = 3, 0, 3, 12
TPS = (1, 2)


def classifier_arch(case: Case) -> str:
    """The Hugging Face class of ``case``'s family's classifier, as its adapter maps it."""
    return architecture_of(family(case.family).spec.classifier_model, {})


def hf_classifier(case: Case) -> torch.nn.Module:
    """A tiny random Hugging Face classifier of ``case``'s family, every parameter perturbed; padding id ``PAD``."""
    import transformers

    torch.manual_seed(0)
    config = hf_config(case, num_labels=CLASSES, pad_token_id=PAD)
    return randomize(getattr(transformers, classifier_arch(case))(config))


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, S], attention_mask [B, S], labels [B]): rows of 12, 7 and 3 real tokens, then ``PAD``s."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, HF_VOCAB, (B, S), generator=g)
    mask = (torch.arange(S) < torch.tensor([[S], [7], [3]])).long()
    return ids.masked_fill(mask == 0, PAD), mask, torch.randint(0, CLASSES, (B,), generator=g)


@pytest.mark.parametrize("name", DECODERS)
def test_classifier_state_dict_round_trips_exactly(name):
    case = DECODERS[name]
    hf = hf_classifier(case)
    original = hf.state_dict()
    class_name, options, config, state = hf_to_tpzoo(hf.config, original, classifier_arch(case))
    assert (class_name, config.num_labels) == (family(case.family).spec.classifier_model, CLASSES)
    assert torch.equal(state["head.score.weight"], original["score.weight"])
    assert not any("output_layer" in k or "lm_head" in k for k in {*state, *original})
    back_config, back, tied = tpzoo_to_hf(class_name, options, config, state)
    assert back.keys() == original.keys(), sorted(set(back) ^ set(original))
    assert all(torch.equal(back[k], original[k]) for k in original)
    assert (back_config.architectures, back_config.num_labels, tied) == ([classifier_arch(case)], CLASSES, set())


@pytest.mark.parametrize("change, message", [(dict(num_labels=1), "num_labels=1 .regression."),
                                             (dict(problem_type="multi_label_classification"), "problem_type")])
def test_a_classifier_tpzoo_cannot_represent_is_refused(change, message):
    case = DECODERS["llama"]
    with pytest.raises(ConversionError, match=f"unsupported Hugging Face config: {message}"):
        hf_to_tpzoo(hf_config(case, **change), {}, classifier_arch(case))


def classifier_checks(tmp: str, expected: dict[str, dict[str, torch.Tensor]]) -> CaseLog:
    """On each rank: each family's Hugging Face classifier folder through ``from_hf`` at tp 1 and 2, its logits and
    mean loss against ``expected``; ``to_hf`` at tp 2 against the folder's weights."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    log, (ids, mask, labels) = CaseLog(), inputs()
    meshes = {tp: init_mesh(tp=tp) for tp in TPS}
    for name in DECODERS:
        folder = Path(tmp) / name
        for tp in TPS:
            with log.case(f"{name}-tp{tp}"):
                model = from_hf(folder, meshes[tp]).eval()
                with torch.no_grad():
                    log.check(model(ids, attention_mask=mask), expected[name]["logits"], f"tp={tp} logits", "logits")
                    loss = model(ids, attention_mask=mask, labels=labels).mean()
                    log.check(loss, expected[name]["loss"], f"tp={tp} loss", "loss")
        with log.case(f"{name}-to-hf-tp2"):
            out = to_hf(model, Path(tmp) / f"{name}-back")
            if dist.get_rank() == 0:
                back, original = load_file(str(out / "model.safetensors")), load_file(str(folder / "model.safetensors"))
                assert back.keys() == original.keys(), sorted(set(back) ^ set(original))
                for key in original:
                    assert torch.equal(back[key], original[key]), f"to_hf(from_hf(m)) at tp=2 changed {key}"
                assert hf_to_tpzoo(*read_hf(out))[2] == model.config
    return log


def case_names() -> list[str]:
    return [f"{name}-{check}" for name in DECODERS for check in (*(f"tp{tp}" for tp in TPS), "to-hf-tp2")]


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> list[CaseLog]:
    tmp = tmp_path_factory.mktemp("classifiers")
    ids, mask, labels = inputs()
    expected = {}
    for name, case in DECODERS.items():
        hf = hf_classifier(case)
        hf.save_pretrained(tmp / name)
        with torch.no_grad():
            out = hf(ids, attention_mask=mask, labels=labels)
        expected[name] = dict(logits=out.logits, loss=out.loss)
    return spawn(classifier_checks, 2, str(tmp), expected)


@pytest.mark.tier("distributed")
def test_classifiers_every_check_has_a_case(logs):
    assert logs[0].ran == case_names()


@pytest.mark.tier("distributed")
@pytest.mark.parametrize("name", case_names())
def test_classifiers_match_hugging_face(logs, name):
    assert_case(logs, name)
