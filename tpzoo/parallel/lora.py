"""LoRA adapters on tensor-parallel linear layers (Hu et al. 2021), split so that no collective is added.

A frozen weight W [out, in] gains B A (scaled by alpha / r), A [r, in], B [out, r], computed as a branch
of the same linear layer, before its collective:

    column (W rows split: W = [W_1; ...; W_p] over out)   A whole, B split like W:  Y_r += s B_r A x
           A's gradient is a partial sum over the tp ranks (each holds B_r): marked ``tp_partial``
    row    (W columns split over in, the sum all-reduced)  A split like W, B whole:  partial_r += s B A_r x_r
           the all-reduce of the layer sums the branch too; B's gradient is the partial sum: ``tp_partial``

so a run with adapters moves exactly the bytes of one without. A is drawn whole (Kaiming-uniform, as PEFT
draws it) from a generator seeded by the seed and the layer's path, then split: the same full adapters at
every tp; B starts at zero (the model starts as the base model). Dropout on a row layer's split input draws
from the tp stream (each rank its own mask), on a column layer's whole input from the default one.

    add_adapters(model, LoRAConfig(rank=8, alpha=16), seed=0)   # in place; returns the adapted paths
    merge_adapters(full_state_dict(model), config)               # W + s B A: the plain model's weights
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo.lora_options import LAYER_LINEARS, LoRAConfig
from tpzoo.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tpzoo.parallel.param_facts import mark
from tpzoo.parallel.random import RNGStatesTracker, TPRandom

ADAPTER = "adapter"  # the attribute of a parallel linear layer holding its adapter


class LowRank(nn.Module):
    """x [..., in] -> s B A dropout(x) [..., out] with ``lora_A`` [r, in] and ``lora_B`` [out, r] (the local
    shapes: a tp rank's shard of whichever factor is split), s = ``scale``."""

    def __init__(self, lora_A: Tensor, lora_B: Tensor, scale: float, dropout: nn.Module) -> None:
        super().__init__()
        self.lora_A, self.lora_B = nn.Parameter(lora_A), nn.Parameter(lora_B)
        self.scale, self.dropout = scale, dropout

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.linear(self.dropout(x), self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def _full_a(rank: int, in_features: int, seed: int, path: str) -> Tensor:
    """A [r, in] as PEFT draws it (Kaiming-uniform with a = sqrt(5): bound 1 / sqrt(in)), from a generator of
    ``seed`` and the layer's ``path``: the same on every rank and at every tp."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(path.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=g) * 2 - 1) * bound


def _adapter(layer: nn.Module, path: str, config: LoRAConfig, seed: int, rng: RNGStatesTracker | None) -> LowRank:
    """The adapter of a column- or row-parallel ``layer`` at ``path``, its factors split as the module docstring
    says and marked for the engine (``param_facts``)."""
    a = _full_a(config.rank, layer.in_features, seed, path).to(layer.weight.device)
    if isinstance(layer, ColumnParallelLinear):
        b = torch.zeros(layer.out_per_rank, config.rank, device=a.device)
        adapter = LowRank(a, b, config.scale, nn.Dropout(config.dropout))
        mark(adapter.lora_A, tp_partial=True)
        mark(adapter.lora_B, tp_split_dim=0, tp_full_size=layer.out_features)
        return adapter
    start = dist.get_rank(layer.tp_group) * layer.in_per_rank
    b = torch.zeros(layer.out_features, config.rank, device=a.device)
    dropout = TPRandom(nn.Dropout(config.dropout), rng) if rng is not None else nn.Dropout(config.dropout)
    adapter = LowRank(a[:, start:start + layer.in_per_rank].clone(), b, config.scale, dropout)
    mark(adapter.lora_A, tp_split_dim=1, tp_full_size=layer.in_features)
    mark(adapter.lora_B, tp_partial=True)
    return adapter


def add_adapters(model: nn.Module, config: LoRAConfig, seed: int = 0) -> list[str]:
    """Give every linear layer of ``model``'s transformer layers named in ``config.targets`` an adapter and freeze
    every other parameter (no gradient, no optimizer state). In place, before the engine is built (``model``: a
    whole model or a pipeline stage); returns the adapted layers' paths. TypeError for a target that is not a
    tensor-parallel linear layer; ValueError when a model with layers has none of the targets."""
    if not config.enabled:
        raise ValueError("LoRAConfig.rank is 0: there are no adapters to add; give a rank >= 1")
    mesh = getattr(model, "mesh", None)
    targets = config.target_names
    found = []
    for path, module in model.named_modules():
        name = path.rsplit(".", 1)[-1]
        if name not in targets or ".layers." not in f".{path}":
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            raise TypeError(f"{path}: --lora-target {name} names a {type(module).__name__}; adapters go on the "
                            f"tensor-parallel linear layers of a parallelized tpzoo model")
        found.append((path, module))
    if not found and len(getattr(model, "layers", ())):  # a pipeline stage without layers has nothing to adapt
        present = sorted({p.rsplit(".", 1)[-1] for p, m in model.named_modules()
                          if isinstance(m, (ColumnParallelLinear, RowParallelLinear))} & set(LAYER_LINEARS))
        raise ValueError(f"--lora-target {config.targets}: no such layer in this model (stage); its transformer "
                         f"layers have {', '.join(present) or 'none'}")
    for p in model.parameters():
        p.requires_grad_(False)
    for path, module in found:
        setattr(module, ADAPTER, _adapter(module, path, config, seed, mesh.rng if mesh is not None else None))
    record = {k: v for k, v in dataclasses.asdict(config).items() if k != "save_adapters_only"}
    model.adapters = dict(record, seed=seed)  # what a checkpoint records to add them again
    return [path for path, _ in found]


def recorded_adapters(record: dict) -> tuple[LoRAConfig, int]:
    """The ``LoRAConfig`` and seed of a model's ``adapters`` record (``add_adapters``)."""
    fields = {k: v for k, v in record.items() if k != "seed"}
    return LoRAConfig(**fields), record["seed"]


def merge_adapters(state: dict[str, Tensor], config: LoRAConfig) -> dict[str, Tensor]:
    """A full state dict (``tpzoo.models.full_state_dict``: whole tensors) with each adapter merged into its
    layer's weight, W + (alpha / r) B A, and the adapters' entries dropped: the plain model's state dict."""
    out = without_adapters(state)
    for key in [k for k in state if k.endswith(f".{ADAPTER}.lora_A")]:
        layer = key.removesuffix(f".{ADAPTER}.lora_A")
        b = state[f"{layer}.{ADAPTER}.lora_B"]
        out[f"{layer}.weight"] = out[f"{layer}.weight"] + config.scale * (b.double() @ state[key].double()).to(b.dtype)
    return out


def without_adapters(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` without the adapters' entries (the base model's weights, unmerged)."""
    return {k: v for k, v in state.items() if f".{ADAPTER}.lora_" not in k}
