"""The checks of tpzoo against tiny Hugging Face models (``families.hf_model``: built from configs, random
init, no hub) of the causal LM, the masked LM with and without its binary head, and the sequence
classifier. Imported by test_models (inside the ranks), and by test_convert_llama for ``mean_loss``."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from families import CAUSAL_LM, CLASSIFIER, MASKED_LM, MASKED_LM_ONLY, hf_model

from tpzoo.convert import from_hf, to_hf

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()


def mean_loss(per_token: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return per_token.sum() / (labels != -100).sum()


def check_hf(errors, mesh, x: dict[str, torch.Tensor], tmp: Path) -> None:
    """from_hf at this mesh's tp: logits and loss equal Hugging Face's; to_hf gives its state dict back."""
    ids, types, mask = x["ids"], x["types"], x["mask"]
    cases = []
    with torch.no_grad():
        hf = hf_model(CAUSAL_LM)
        model = from_hf(hf, mesh).eval()
        expected = hf(ids, labels=ids)
        cases.append((hf, model, {"logits": (model(ids), expected.logits),
                                  "loss": (mean_loss(model(ids, labels=x["next"]), x["next"]), expected.loss)}))
        hf = hf_model(MASKED_LM)
        model = from_hf(hf, mesh).eval()
        expected = hf(ids, attention_mask=mask, token_type_ids=types)
        mlm, binary = model(ids, types, mask, return_binary_logits=True)
        cases.append((hf, model, {"logits": (mlm, expected.prediction_logits),
                                  "binary": (binary, expected.seq_relationship_logits)}))
        hf = hf_model(MASKED_LM_ONLY)
        model = from_hf(hf, mesh).eval()
        expected = hf(ids, attention_mask=mask, token_type_ids=types, labels=x["mlm"])
        loss = mean_loss(model(ids, types, mask, labels=x["mlm"]), x["mlm"])
        cases.append((hf, model, {"logits": (model(ids, types, mask), expected.logits), "loss": (loss, expected.loss)}))
        hf = hf_model(CLASSIFIER)
        model = from_hf(hf, mesh).eval()
        expected = hf(ids, attention_mask=mask, token_type_ids=types, labels=x["cls"])
        loss = model(ids, types, mask, labels=x["cls"]).mean()
        cases.append((hf, model, {"logits": (model(ids, types, mask), expected.logits), "loss": (loss, expected.loss)}))
    for hf, model, outputs in cases:
        tag = f"{type(hf).__name__} tp={mesh.tp_size}"
        for name, (ours, theirs) in outputs.items():
            errors.check(ours, theirs, f"{tag} {name}", "tpzoo vs hf")
        out = to_hf(model, tmp / type(hf).__name__)
        back = type(hf).from_pretrained(out).state_dict()
        original = hf.state_dict()
        assert back.keys() == original.keys(), f"{tag}: to_hf keys differ {sorted(set(back) ^ set(original))}"
        for k in original:
            assert torch.equal(back[k], original[k]), f"{tag}: to_hf(from_hf(m)) changed {k}"
