"""LoRA checkpoints (tpzoo.parallel.lora, tpzoo.checkpoint): on 2 gloo ranks (tp 2), llama-tiny with rank-8
adapters trains 3 steps from a base model folder; its full checkpoint and its adapters-only one
(``adapters_of``: the base) both load (``load_model`` adds the adapters again) to the trained model's logits;
the adapters-only checkpoint (adapters and their AdamW state) is under 5% of a full fine-tuning checkpoint's
bytes (every weight and its state; measured: 443,310 of 10,763,839 B, 4.1%; the same run's full checkpoint:
4,003,432 B); ``to_hf`` merges the adapters, and Hugging Face's model of that folder gives the tpzoo model's logits
within 1e-5; ``python -m tpzoo.convert to-hf ADAPTERS OUT --peft DIR`` writes the base weights and a PEFT folder that
``peft.PeftModel`` opens over them, to the same logits. Under bf16 the frozen weights have no float32 main copy
(the engine's main parameter of each is the bf16 weight itself), stay bit-identical through training, and a
checkpoint's save and load into a fresh engine give the trained logits back exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from families import GQA_LM, batch

from tpzoo.lora_options import LoRAConfig
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")

LORA = LoRAConfig(rank=8, alpha=16.0)
B, S = 2, 16


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def base_model(tmp: Path):
    """(plan, config) of tp 2, with a seeded llama-tiny saved as the model folder ``tmp``/base."""
    from tpzoo.models.pretrained import save_pretrained
    from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed

    plan = ParallelPlan(init_mesh(tp=2), kernels="torch")
    manual_seed(0, plan.mesh)
    config = GQA_LM.config()
    save_pretrained(GQA_LM.build(config, plan), tmp / "base")
    return plan, config


def lora_engine(tmp: Path, plan, config, precision: str = "fp32"):
    """An engine of ``tmp``/base with rank-8 adapters (its other weights frozen)."""
    from tpzoo.checkpoint import load_model
    from tpzoo.engine import Engine, EngineConfig
    from tpzoo.parallel.lora import add_adapters

    def build(plan, **stage):
        model = load_model(tmp / "base", plan, **stage)
        add_adapters(model, LORA, seed=1)
        return model
    return Engine(build, config, EngineConfig(micro_batch_size=B, global_batch_size=B, lr=1e-2, precision=precision),
                  plan)


def lora_checkpoints(tmp: str) -> dict:
    from tpzoo.checkpoint import load_model, save_checkpoint
    from tpzoo.convert import to_hf
    from tpzoo.engine import Engine, EngineConfig

    tmp = Path(tmp)
    plan, config = base_model(tmp)
    engine = lora_engine(tmp, plan, config)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        engine.train_step(batch(GQA_LM, torch.randint(0, config.vocab_size, (B, S), generator=g), g))
    ids = torch.randint(0, config.vocab_size, (B, S), generator=g)
    model = engine.chunks[0].model.eval()
    with torch.no_grad():
        trained = model(ids)
    save_checkpoint(tmp / "full", 3, engine, meta={})
    whole = Engine(lambda plan, **stage: load_model(tmp / "base", plan, **stage), config,
                   EngineConfig(micro_batch_size=B, global_batch_size=B, lr=1e-2), plan)  # full fine-tuning
    whole.train_step(batch(GQA_LM, ids, g))
    save_checkpoint(tmp / "full-finetuning", 1, whole, meta={})
    save_checkpoint(tmp / "adapters", 3, engine, meta={}, adapters_of=str(tmp / "base"))
    out = {"ids": ids, "trained": trained}
    for name in ("full", "adapters"):
        loaded = load_model(tmp / name, plan).eval()
        assert loaded.adapters == model.adapters and not any(p.requires_grad for n, p in loaded.named_parameters()
                                                             if "lora_" not in n)
        with torch.no_grad():
            out[name] = loaded(ids)
    to_hf(loaded, tmp / "hf")
    return out


def test_lora_checkpoints_load_merge_and_stay_small(tmp_path):
    import transformers

    out = spawn(lora_checkpoints, 2, str(tmp_path))[0]
    for name in ("full", "adapters"):
        assert torch.equal(out[name], out["trained"]), f"the {name} checkpoint loads other weights"
    sizes = {name: folder_bytes(tmp_path / name) for name in ("adapters", "full", "full-finetuning")}
    print("checkpoint bytes:", sizes)
    assert sizes["adapters"] < 0.05 * sizes["full-finetuning"], f"adapters-only is not under 5%: {sizes}"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        merged = hf(out["ids"]).logits
    err = ((merged - out["trained"]).abs().max() / out["trained"].abs().max()).item()
    assert err < 1e-5, f"the merged Hugging Face model's logits differ by {err:.2e}"

    import peft

    from tpzoo.convert.__main__ import main as convert_main

    assert convert_main(["to-hf", str(tmp_path / "adapters"), str(tmp_path / "base-hf"),
                         "--peft", str(tmp_path / "peft")]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf")
    with torch.no_grad():
        unmerged = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()(out["ids"]).logits
    err = ((unmerged - out["trained"]).abs().max() / out["trained"].abs().max()).item()
    assert err < 1e-5, f"PEFT's model of the adapters folder gives logits off by {err:.2e}"


def bf16_lora(tmp: str) -> dict:
    from tpzoo.checkpoint import load_checkpoint, save_checkpoint

    tmp = Path(tmp)
    plan, config = base_model(tmp)
    trained = lora_engine(tmp, plan, config, "bf16")
    frozen = {n: p.detach().clone() for n, p in trained.chunks[0].model.named_parameters() if not p.requires_grad}
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        trained.train_step(batch(GQA_LM, torch.randint(0, config.vocab_size, (B, S), generator=g), g))
    model = trained.chunks[0].model
    own_main = all(trained.main.main_of(p) is p for p in model.parameters() if not p.requires_grad)
    unchanged = all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    save_checkpoint(tmp / "bf16", 3, trained, meta={})
    fresh = lora_engine(tmp, plan, config, "bf16")
    with torch.no_grad():  # the fresh engine's frozen weights perturbed: the load must write them
        for p in fresh.chunks[0].model.parameters():
            if not p.requires_grad:
                p.add_(1.0)
    load_checkpoint(tmp / "bf16", fresh)
    ids = torch.randint(0, config.vocab_size, (B, S), generator=g)
    with torch.no_grad():
        same = torch.equal(model.eval()(ids), fresh.chunks[0].model.eval()(ids))
    return {"own_main": own_main, "unchanged": unchanged, "same": same, "frozen": len(frozen)}


def test_bf16_lora_keeps_no_float32_copy_of_frozen_weights_and_resumes_exactly(tmp_path):
    out = spawn(bf16_lora, 2, str(tmp_path))[0]
    assert out["frozen"] > 0 and out["own_main"], out
    assert out["unchanged"], "a frozen weight changed in training"
    assert out["same"], "the bf16 LoRA checkpoint loads other weights"
