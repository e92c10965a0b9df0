"""Forward-only passes of a global batch through the engine's chunks: validation loss, logits.

    outputs = forward_only(engine, batch)                  # this dp rank's micro-batches, every pp rank
    loss = eval_loss(engine, batch)                        # global-batch mean token loss, no update
    loss, parts = eval_losses(engine, batch)               # and its part of each label key
    logits = eval_logits(engine, batch)                    # [G, ...] over dp, on every rank

The same runner as ``train_step`` (``engine.runner``, see ``tpzoo.engine.pipeline``), forward
only: with pp > 1 the training schedule runs its forward actions and skips the backward ones
(``schedule.eval``), stages exchanging hidden states of the stage's ``boundary_shape`` as in
training. Each stage gets its micro-batch's extras as in ``train_step``
(``engine.micro_batches``); the chunks run under no_grad, in eval mode (dropout off; each chunk's
mode is restored afterwards), in the model's dtype (``mixed_precision``). Losses are summed over pp and dp as in
training; the last stage's outputs are broadcast to the other ranks of its pp group.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from tpzoo.engine.train_step import Engine, named_losses, reduce_losses
from tpzoo.parallel.health import peers_named


@contextmanager
def _evaluating(engine: Engine) -> Iterator[None]:
    """The engine's chunks in eval mode under no_grad; their modes are restored afterwards, and FSDP's root
    units resharded (FSDP keeps a root gathered after its forward, for the backward that follows in training:
    left so, a checkpoint would save the gathered weights' freed storage, a segfault in DCP's write). A failed
    collective inside names the missing peers (``tpzoo.parallel.health.peers_named``)."""
    modes = [chunk.training for chunk in engine.chunks]
    try:
        for chunk in engine.chunks:
            chunk.eval()
        with torch.no_grad(), peers_named("evaluation", engine.mesh, engine.config.timeout_s):
            yield
    finally:
        for chunk, mode in zip(engine.chunks, modes):
            chunk.train(mode)
            if isinstance(chunk, FSDPModule):
                chunk.reshard()


def _broadcast_last(engine: Engine, out: Tensor | None) -> Tensor:
    """The last stage's output (float32, any shape) on every rank of the pp group: shape, then data."""
    mesh = engine.mesh
    if mesh.pp_size == 1:
        return out
    src = dist.get_global_rank(mesh.pp_group, (engine.num_stages - 1) % mesh.pp_size)
    ndim = torch.tensor([out.dim() if out is not None else 0], device=mesh.device)
    dist.broadcast(ndim, src=src, group=mesh.pp_group)
    shape = torch.tensor(out.shape if out is not None else [0] * int(ndim), dtype=torch.long, device=mesh.device)
    dist.broadcast(shape, src=src, group=mesh.pp_group)
    data = out.contiguous() if out is not None else torch.empty(shape.tolist(), device=mesh.device)
    dist.broadcast(data, src=src, group=mesh.pp_group)
    return data


def forward_only(engine: Engine, batch: dict[str, Tensor], *, logits: bool = False) -> list[tuple[Tensor, ...]]:
    """The last stage's model outputs (float32) for each of this dp rank's micro-batches,
    on every rank of the pp group (and the same on the tp ranks): one tuple per micro-batch.

    ``batch`` is a global batch as ``train_step`` takes it (input_ids [G, s], labels, BERT's extras).
    ``logits=False``: the model's losses given the labels, one per label key of the model's
    ``label_keys`` in the batch: per-token losses [mbs, s] (GPT, BERT MLM), then BERT's per-pair
    sentence-order losses [mbs] when ``next_sentence_label`` is given; per-example losses [mbs] for
    sequence classification. ``logits=True``: the labels are withheld and the tuple holds the
    logits, [mbs, s, V] or [mbs, num_labels].
    """
    ids, extras = engine.micro_batches(batch, labels=not logits)
    with _evaluating(engine):
        engine.runner.run(ids, extras, backward=False, keep=True)
        kept = engine.runner.outputs()  # on the ranks of the last stage only
        returned = 1 if logits else len(engine.loss_keys(batch))  # outputs of the last stage
        return [tuple(_broadcast_last(engine, kept[k][j] if kept is not None else None) for j in range(returned))
                for k in range(len(ids))]


def gather_dp(engine: Engine, outputs: list[tuple[Tensor, ...]]) -> Tensor:
    """This dp rank's micro-batch outputs (the first of each tuple, [mbs, ...]) -> the whole global batch's [G, ...], in
    batch order (dp rank d holds rows [d G/dp, (d+1) G/dp)), on every rank."""
    if engine.mesh.cp_size > 1:
        raise ValueError(f"the model's outputs of whole sequences are not gathered under context parallelism "
                         f"(cp={engine.mesh.cp_size}); evaluate them at cp 1")
    local = torch.cat([out[0] for out in outputs])
    parts = [torch.empty_like(local) for _ in range(engine.mesh.dp_size)]
    dist.all_gather(parts, local, group=engine.mesh.dp_group)
    return torch.cat(parts)


def eval_losses(engine: Engine, batch: dict[str, Tensor]) -> tuple[float, dict[str, float]]:
    """The global-batch mean loss as ``train_step`` reports it (for each label key, its part: the sum of
    its losses / its non-ignored count in the global batch; the parts added up: BERT's MLM +
    sentence-order loss), and the parts by label key, without updating anything: the same numbers on
    every rank and mesh (one all-reduce over pp and dp of [1 + K] numbers, as in ``train_step``)."""
    ids, extras = engine.micro_batches(batch)
    with _evaluating(engine):
        total, parts = engine.runner.run(ids, extras, backward=False)
        sums = reduce_losses(total, parts, [engine.mesh.pp_group, engine.mesh.dp_cp_group])
        return named_losses(sums.tolist(), engine.loss_keys(batch))


def eval_loss(engine: Engine, batch: dict[str, Tensor]) -> float:
    """The global-batch mean loss of ``eval_losses``, the parts added up."""
    return eval_losses(engine, batch)[0]


def eval_logits(engine: Engine, batch: dict[str, Tensor]) -> Tensor:
    """The logits of the whole global batch on every rank: [G, num_labels] for a sequence classifier,
    [G, s, V] for a language model."""
    return gather_dp(engine, forward_only(engine, batch, logits=True))
