"""Hugging Face conversion of the pretrain runs' GPT and BERT: ``python -m tpzoo.convert to-hf`` of the
training checkpoint (saved on the device, read on the CPU), ``from-hf`` of that export, and the logits of
all three on the device (hf_logits.py): tpzoo's kernels against transformers' own ops."""

from __future__ import annotations

import json

import pytest
from families import CAUSAL_LM, MASKED_LM
from gpu_helpers import DEVICE, GPU_DIR, run

# float32 on both sides; the ops differ (Triton LayerNorm and GELU, sdpa or the fused softmax vs
# transformers'), so the logits agree to float32 rounding, not bit for bit
LOGITS_RTOL = 1e-4


@pytest.mark.parametrize("model", [CAUSAL_LM.family, MASKED_LM.family])
def test_hugging_face_export_and_import_give_the_checkpoint_logits(pretrained, work, model):
    checkpoint, hf, back = pretrained(model, "bf16"), f"{model}-hf", f"{model}-hf-tpzoo"
    run(["-m", "tpzoo.convert", "to-hf", str(checkpoint), hf], work)
    run(["-m", "tpzoo.convert", "from-hf", hf, back], work)
    done = run([str(GPU_DIR / "hf_logits.py"), str(checkpoint), hf, back], work)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    assert result["device"].startswith(DEVICE), result
    assert len(result["errors"]) == (4 if model == MASKED_LM.family else 2)  # its binary head's logits too
    assert all(err <= LOGITS_RTOL for err in result["errors"].values()), result["errors"]
