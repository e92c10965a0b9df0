"""The experts as one grouped multiply (``--moe-grouped-gemm``: ``torch._grouped_mm``, CUTLASS's grouped GEMM on
Hopper in bfloat16) against the loop over experts, on the device: a mixture of 8 experts, top 2, one expert reached
by no token; the largest relative difference of the outputs, the input gradients and every weight gradient, in
bfloat16 and in float32. On the CPU (no CUDA device) the same on the CPU.

    python tests/gpu/moe_grouped.py

Prints one JSON line: {"device": ..., "bfloat16": error, "float32": error}.
"""

from __future__ import annotations

import json

import torch

from tpzoo.models.moe import MoE

H, F, E, B, S = 256, 512, 8, 4, 128


def grads(moe: MoE, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = moe(x)
    out.float().square().sum().backward()
    return [out.detach().float(), x.grad.float(), *(p.grad.float() for p in moe.parameters())]


def error(dtype: torch.dtype, device: torch.device) -> float:
    torch.manual_seed(0)
    loop, grouped = MoE(H, E, 2, F).to(device, dtype), MoE(H, E, 2, F).to(device, dtype)
    grouped.load_state_dict(loop.state_dict())
    grouped.experts.grouped_gemm = True
    with torch.no_grad():  # expert 7 gets no token (the inputs are positive): an empty group
        for moe in (loop, grouped):
            moe.router.weight[E - 1] = -1.0
    x = torch.rand(B, S, H, device=device, dtype=dtype)
    pairs = zip(grads(grouped, x), grads(loop, x))
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in pairs)


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(json.dumps({"device": str(device), **{str(d).removeprefix("torch."): error(d, device)
                                                for d in (torch.bfloat16, torch.float32)}}))


if __name__ == "__main__":
    main()
