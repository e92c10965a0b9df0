"""Tensor-parallel linear and embedding layers (Megatron-LM layout).

Every layer first builds its *full* weight in float32 on the CPU from the default generator,
then keeps its own shard, so the same seed gives the same full weights at every tp (this costs
one full weight of host memory while a layer is built). Weight layouts match Megatron-LM:

    ColumnParallelLinear   weight [out/tp, in]   rows r*out/tp ... of the full [out, in]
    RowParallelLinear      weight [out, in/tp]   cols r*in/tp ...  of the full [out, in]
    VocabParallelEmbedding weight [V'/tp, h]     rows r*V'/tp ...  of the vocabulary padded to V'

Sharded parameters are marked with the dim split across tp (``param_facts``), so that gradient
norms, checkpoints and conversions can tell shards from replicas. ``tp_group=None`` means the tp
group of the mesh made by ``init_mesh``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tpzoo.parallel.collectives import (
    SEQ_DIM,
    all_reduce,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    resolve_tp_group,
    scatter_to_tp_region,
)
from tpzoo.parallel.cross_entropy import vocab_parallel_cross_entropy
from tpzoo.parallel.fsdp import local
from tpzoo.parallel.param_facts import facts, mark
from tpzoo.parallel.token_ids import assert_in_range

InitMethod = Callable[[Tensor], object]


def init_method_normal(std: float = 0.02) -> InitMethod:
    """N(0, std^2), Megatron-LM's and GPT-2's default."""
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, (std / sqrt(2 num_layers))^2) for the projections that feed the residual stream (GPT-2)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def divide(n: int, d: int, what: str) -> int:
    """n / d, or a ValueError naming both when d does not divide n."""
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size tp={d}; "
                         f"choose {what} a multiple of {d} or another tp")
    return n // d


def _shard(full_shape: tuple[int, int], init_method: InitMethod, dim: int, group: dist.ProcessGroup,
           dtype: torch.dtype | None, device: torch.device | str | None, padded_rows: int | None = None) -> nn.Parameter:
    """Build the full weight, zero-pad its rows to ``padded_rows``, keep this rank's chunk of ``dim``."""
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    if padded_rows is not None:
        master = F.pad(master, (0, 0, 0, padded_rows - full_shape[0]))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = master.chunk(world, dim)[rank]
    param = nn.Parameter(shard.to(dtype=dtype or torch.get_default_dtype(), device=device).contiguous())
    return mark(param, tp_split_dim=dim, tp_full_size=full_shape[dim])  # the real size: padding is cut off


def _check_last_dim(x: Tensor, expected: int, layer: str) -> None:
    if x.shape[-1] != expected:
        raise ValueError(f"{layer} expects inputs [..., {expected}] on each tp rank, got {tuple(x.shape)}")


def _bias(size: int, bias: bool, dtype: torch.dtype | None, device: torch.device | str | None) -> nn.Parameter | None:
    return nn.Parameter(torch.zeros(size, dtype=dtype, device=device)) if bias else None


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns: A = [A_1 ... A_p], b = [b_1 ... b_p].

    Rank r computes Y_r = X A_r + b_r, [..., out/tp]. The input X [..., in] is replicated on the
    tp ranks (``copy_to_tp_region``), or with ``sequence_parallel`` arrives as [b, s/tp, in] and
    is all-gathered along the sequence. ``gather_output`` all-gathers Y to [..., out].
    ``skip_bias_add`` returns (Y without b, b) so the caller can fuse the add.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 init_method: InitMethod | None = None, skip_bias_add: bool = False, sequence_parallel: bool = False,
                 tp_group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if gather_output and skip_bias_add:
            raise ValueError("ColumnParallelLinear: gather_output=True with skip_bias_add=True would return the "
                             "full output with this rank's bias shard; add the bias (skip_bias_add=False)")
        self.tp_group = resolve_tp_group(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, dist.get_world_size(self.tp_group), "out_features")
        self.gather_output, self.skip_bias_add, self.sequence_parallel = gather_output, skip_bias_add, sequence_parallel
        self.weight = _shard((out_features, in_features), init_method or init_method_normal(), 0,
                             self.tp_group, dtype, device)
        self.bias = _bias(self.out_per_rank, bias, self.weight.dtype, self.weight.device)
        if self.bias is not None:
            mark(self.bias, tp_split_dim=0, tp_full_size=out_features)
        self.adapter: nn.Module | None = None  # X -> [..., out/tp] added to Y_r (tpzoo.parallel.lora)

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor | None]:
        _check_last_dim(x, self.in_features, "ColumnParallelLinear")
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, SEQ_DIM)
        else:
            x = copy_to_tp_region(x, self.tp_group)
        y = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        if self.adapter is not None:
            y = y + self.adapter(x)
        if self.gather_output:
            y = gather_from_tp_region(y, self.tp_group)
        return (y, self.bias) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_per_rank} per rank), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows: A = [A_1; ...; A_p], X = [X_1 ... X_p].

    Rank r computes the partial product X_r A_r; the partials are summed across tp
    (``reduce_from_tp_region``) and the replicated bias b added once. ``input_is_parallel``:
    X arrives as [..., in/tp] (the output of a ColumnParallelLinear); otherwise [..., in] is split
    here. With ``sequence_parallel`` the sum is reduce-scattered along the sequence to
    [b, s/tp, out], and the bias is marked ``tp_partial`` (its gradient is a partial sum
    over the sequence shards: ``sync_sequence_parallel_grads`` completes it).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 init_method: InitMethod | None = None, skip_bias_add: bool = False, sequence_parallel: bool = False,
                 tp_group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.tp_group = resolve_tp_group(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, dist.get_world_size(self.tp_group), "in_features")
        self.input_is_parallel, self.skip_bias_add, self.sequence_parallel = (
            input_is_parallel, skip_bias_add, sequence_parallel)
        self.weight = _shard((out_features, in_features), init_method or init_method_normal(), 1,
                             self.tp_group, dtype, device)
        self.bias = _bias(out_features, bias, self.weight.dtype, self.weight.device)
        if self.bias is not None:
            mark(self.bias, tp_partial=sequence_parallel)
        self.adapter: nn.Module | None = None  # X_r -> [..., out] added to the partial X_r A_r (tpzoo.parallel.lora)

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor | None]:
        if self.input_is_parallel:
            _check_last_dim(x, self.in_per_rank, "RowParallelLinear(input_is_parallel=True)")
        else:
            _check_last_dim(x, self.in_features, "RowParallelLinear(input_is_parallel=False)")
            x = scatter_to_tp_region(x, self.tp_group)
        partial = F.linear(x, self.weight)
        if self.adapter is not None:
            partial = partial + self.adapter(x)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group, SEQ_DIM)
        else:
            y = reduce_from_tp_region(partial, self.tp_group)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} per rank), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """The vocabulary rounded up to a multiple of ``multiple x tp`` (Megatron's make-vocab-size-divisible-by)."""
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"vocab_size and multiple must be >= 1, got vocab_size={vocab_size}, multiple={multiple}")
    step = multiple * tp
    return -(-vocab_size // step) * step


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary is split across tp ranks.

    The vocabulary V is padded to V' (a multiple of ``pad_vocab_to_multiple_of`` x tp) with zero
    rows that no valid id reaches; rank r holds rows [r V'/tp, (r+1) V'/tp). Each rank looks up
    the ids in its range, writes zeros for the others, and the tp ranks sum: [b, s] -> [b, s, h]
    (``sequence_parallel``: reduce-scattered to [b, s/tp, h]). Ids outside [0, V) fail a device-side
    assertion (``token_ids``; no host-device sync: check a batch on the host with ``check_token_ids``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, init_method: InitMethod | None = None,
                 pad_vocab_to_multiple_of: int = 128, sequence_parallel: bool = False,
                 tp_group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        tp = dist.get_world_size(self.tp_group)
        self.num_embeddings, self.embedding_dim, self.sequence_parallel = num_embeddings, embedding_dim, sequence_parallel
        self.num_embeddings_padded = padded_vocab_size(num_embeddings, tp, pad_vocab_to_multiple_of)
        per_rank = self.num_embeddings_padded // tp
        self.vocab_start_index = dist.get_rank(self.tp_group) * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.weight = _shard((num_embeddings, embedding_dim), init_method or init_method_normal(), 0,
                             self.tp_group, dtype, device, padded_rows=self.num_embeddings_padded)

    def forward(self, input_ids: Tensor) -> Tensor:
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"VocabParallelEmbedding expects int32/int64 ids, got {input_ids.dtype}")
        assert_in_range(input_ids, self.num_embeddings, "token ids")  # asynchronous: no host-device sync
        tp = dist.get_world_size(self.tp_group)
        if self.sequence_parallel and input_ids.shape[-1] % tp:
            raise ValueError(f"sequence length {input_ids.shape[-1]} is not divisible by tp={tp}: sequence "
                             f"parallelism splits the sequence; use a multiple of {tp}")
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group, SEQ_DIM)
        return reduce_from_tp_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded to {self.num_embeddings_padded}; rows {self.vocab_start_index}:"
                f"{self.vocab_end_index} here), {self.embedding_dim}, sequence_parallel={self.sequence_parallel}")


class VocabParallelOutput(nn.Module):
    """An LM head's output over a vocab-parallel weight: logits_r = H E_r^T (+ b_r), then the loss or the logits.

    forward(hidden [b, s, h] ([b, s/tp, h] with ``sequence_parallel``), weight [V'/tp, h], labels [b, s] | None,
    bias [V'/tp] | None) -> per-token loss [b, s] (float32, 0 where labels == -100; the vocabulary is never
    gathered: ``vocab_parallel_cross_entropy``) | logits [b, s, V] (gathered, cut to the real vocabulary).
    Each rank's gradient of ``hidden`` is a partial sum over its vocabulary slice: the copy into the region
    all-reduces it, or with sequence parallelism the all-gather of the sequence reduce-scatters it.
    ``kernels``: the backend of the fused cross entropy.
    """

    def __init__(self, vocab_size: int, sequence_parallel: bool = False, tp_group: dist.ProcessGroup | None = None,
                 kernels: str | None = None) -> None:
        super().__init__()
        self.vocab_size, self.sequence_parallel, self.kernels = vocab_size, sequence_parallel, kernels
        self.tp_group = resolve_tp_group(tp_group)

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor | None = None,
                bias: Tensor | None = None) -> Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group, tensor_parallel_output_grad=True)
        else:
            hidden = copy_to_tp_region(hidden, self.tp_group)
        logits = F.linear(hidden, weight, bias)                                   # [b, s, V'/tp]
        if labels is not None:
            return vocab_parallel_cross_entropy(logits, labels, vocab_size=self.vocab_size, tp_group=self.tp_group,
                                                backend=self.kernels)
        return gather_from_tp_region(logits, self.tp_group)[..., :self.vocab_size]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, sequence_parallel={self.sequence_parallel}, kernels={self.kernels}"


def sync_sequence_parallel_grads(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce over tp the gradients of parameters marked ``tp_partial`` (``param_facts``).

    Such parameters (LayerNorm weights, a row-parallel bias) are replicated but act on a sequence
    shard, so each tp rank holds a partial gradient. Call after backward, before the optimizer.
    """
    grads = [local(p.grad) for p in module.parameters() if facts(p).tp_partial and p.grad is not None]
    if not grads:
        return
    flat = all_reduce(torch._utils._flatten_dense_tensors(grads), resolve_tp_group(group))
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
