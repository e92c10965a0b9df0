"""Forward and backward of every case of ``families.CASES`` (tp 1, both attention backends, the
device's kernels, dropout on) with ``torch.cuda.set_sync_debug_mode("error")``: any host-device
synchronisation inside them raises. Each case runs one warm-up step first (Triton compiles its
kernels then), and the checked step after it. On the CPU the steps run without the sync check.
The mixtures of experts run their experts as one grouped multiply (``ParallelPlan.grouped_gemm``: the
loop over experts reads the token counts on the host by design) in bfloat16 (torch._grouped_mm's
grouped GEMM); ``SYNCS`` are left out: a capacity factor reads the kept slots' count (docs/moe.md).

    python tests/gpu/no_sync.py

Prints one JSON line: {"device": ..., "checked": [case-attention, ...]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: families

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from families import CASES, batch, without_labels  # noqa: E402

from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed  # noqa: E402

SYNCS = tuple(name for name, case in CASES.items() if getattr(case.config(), "moe_expert_capacity_factor", None))
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=101,
            max_position_embeddings=32, hidden_dropout=0.1, attention_dropout=0.1)


def step(model, kwargs: dict[str, torch.Tensor]) -> None:
    out = model(**kwargs)
    sum(part.sum() for part in (out if isinstance(out, tuple) else (out,))).backward()


def main() -> None:
    mesh = init_mesh(tp=1)
    manual_seed(0, mesh)
    checked = []
    for name, case in CASES.items():
        if name in SYNCS:
            continue
        config = case.config(**TINY, **({"num_labels": 3} if case.inputs == "classification" else {}))
        experts = getattr(config, "num_experts", None) is not None
        g = torch.Generator().manual_seed(0)
        data = batch(case, torch.randint(0, TINY["vocab_size"], (2, 16), generator=g), g)
        for attention in ("sdpa", "fused-softmax"):
            model = case.build(config, ParallelPlan(mesh, attention_backend=attention, grouped_gemm=experts))
            model = model.to(torch.bfloat16) if experts else model
            kwargs = {k: v.to(mesh.device) for k, v in without_labels(data).items()}
            kwargs.update({k: data[k].to(mesh.device) for k in model.label_keys})
            step(model, kwargs)
            if mesh.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                step(model, kwargs)
            finally:
                if mesh.device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
            checked.append(f"{name}-{attention}")
    print(json.dumps({"device": str(mesh.device), "checked": checked}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
