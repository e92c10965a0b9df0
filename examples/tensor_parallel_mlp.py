"""A tensor-parallel MLP built from tpzoo's layers, checked against the same MLP in plain PyTorch.

    python examples/tensor_parallel_mlp.py                              # one process, tp=1
    torchrun --nproc-per-node 2 examples/tensor_parallel_mlp.py --tp 2  # two ranks, tp=2

The MLP is Megatron's pair: Y = GeLU(X A) B with A split by columns and B by rows, so the only
communication is one all-reduce of Y in forward (and one of dL/dX in backward).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpzoo.parallel import ColumnParallelLinear, RowParallelLinear, init_mesh
from tpzoo.parallel.collectives import all_gather


class ParallelMLP(nn.Module):
    """[b, s, h] -> [b, s, h]; the 4h hidden features are split across the tp ranks."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(hidden, 4 * hidden)     # weight [4h/tp, h]
        self.down = RowParallelLinear(4 * hidden, hidden)      # weight [h, 4h/tp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()

    mesh = init_mesh(tp=args.tp)
    torch.manual_seed(0)                       # the same full weights on every rank, whatever tp is
    mlp = ParallelMLP(args.hidden)
    x = torch.randn(2, 16, args.hidden, requires_grad=True)
    mlp(x).square().mean().backward()

    dense = nn.Sequential(nn.Linear(args.hidden, 4 * args.hidden), nn.GELU(), nn.Linear(4 * args.hidden, args.hidden))
    with torch.no_grad():                      # gather the shards into the dense model
        dense[0].weight.copy_(all_gather(mlp.up.weight, 0, mesh.tp_group))
        dense[0].bias.copy_(all_gather(mlp.up.bias, 0, mesh.tp_group))
        dense[2].weight.copy_(all_gather(mlp.down.weight, 1, mesh.tp_group))
        dense[2].bias.copy_(mlp.down.bias)
    x_dense = x.detach().clone().requires_grad_()
    dense(x_dense).square().mean().backward()

    err = (x.grad - x_dense.grad).abs().max().item() / x_dense.grad.abs().max().item()
    if dist.get_rank() == 0:
        print(f"tp={mesh.tp_size}: input-gradient relative error against dense PyTorch {err:.2e}")
    dist.destroy_process_group()
    if err > 1e-5:
        raise SystemExit(f"tensor-parallel MLP differs from dense by {err:.2e} (> 1e-5)")


if __name__ == "__main__":
    main()
