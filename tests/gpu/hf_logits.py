"""Logits of one model three ways on this process's device, compared: a training checkpoint loaded
with tpzoo, its Hugging Face export (``to-hf``) run by transformers, and that export converted back
(``from-hf``) and loaded with tpzoo. Float32; BERT with token types and a padded row (whose padded
positions are left out of the comparison).

    python tests/gpu/hf_logits.py CHECKPOINT HF_DIR TPZOO_DIR

Prints one JSON line: {"device": ..., "errors": {name: max |ours - hf| / max |hf|, ...}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: families

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from families import MASKED_LM  # noqa: E402

from tpzoo.checkpoint import load_model  # noqa: E402
from tpzoo.parallel import init_mesh  # noqa: E402

BATCH, SEQ, PAD = 2, 24, 7  # the last row ends in PAD padding tokens


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max()).item()


@torch.no_grad()
def main(checkpoint: str, hf_dir: str, tpzoo_dir: str) -> None:
    mesh = init_mesh()
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    hf = getattr(transformers, config.architectures[0]).from_pretrained(hf_dir).to(mesh.device).eval()
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(mesh.device)
    mask = torch.ones_like(ids)
    mask[-1, SEQ - PAD:] = 0
    types = (torch.arange(SEQ, device=mesh.device) >= SEQ // 2).long().expand(BATCH, SEQ)
    real = mask.bool()
    if config.model_type == MASKED_LM.hf_model_type:
        expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        theirs = {"logits": expected.prediction_logits[real], "binary": expected.seq_relationship_logits}

        def outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
            mlm, binary = model(ids, types, mask, return_binary_logits=True)
            return {"logits": mlm[real], "binary": binary}
    else:
        theirs = {"logits": hf(ids).logits}

        def outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
            return {"logits": model(ids)}
    errors = {}
    for source, path in (("checkpoint", checkpoint), ("from-hf", tpzoo_dir)):
        ours = outputs(load_model(path, mesh).eval())
        errors.update({f"{source} {name} vs hf": rel_err(ours[name], theirs[name]) for name in theirs})
    print(json.dumps({"device": str(hf.device), "errors": errors}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
