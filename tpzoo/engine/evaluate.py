"""Forward-only passes of a global batch through the engine's chunks: validation loss, logits.

    outputs = forward_only(engine, batch)                  # this dp rank's micro-batches, every pp rank
    loss = eval_loss(engine, batch)                        # global-batch mean token loss, no update
    loss, parts = eval_losses(engine, batch)               # and its part of each label key
    logits = eval_logits(engine, batch)                    # [G, ...] over dp, on every rank

No backward and no training schedule: with pp > 1 every micro-batch walks the stages in order,
stage i (chunk i // pp of pp rank i % pp) receiving its input [mbs, s(/tp), h] (float32) from
stage i - 1 and sending its output to stage i + 1 over ``mesh.pp_group``, blocking. Every rank
walks micro-batches and stages in the same order, so the sends and receives pair up. Each stage
gets its micro-batch's extras as in ``train_step`` (``engine._feeds``); the chunks run under
no_grad, in eval mode (dropout off; each chunk's mode is restored afterwards), under the
engine's autocast. The last stage's outputs are broadcast to the other ranks of its pp group.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor

from tpzoo.engine.pipeline import LOSS_LABELS
from tpzoo.engine.train_step import AUTOCAST, Engine, label_counts, loss_keys, reduce_losses


def _pp_rank_of(engine: Engine, pp_rank: int) -> int:
    return dist.get_global_rank(engine.mesh.pp_group, pp_rank)


def _stage_input(engine: Engine, stage: int, ids: Tensor) -> Tensor:
    """Stage ``stage``'s input for this micro-batch: the token ids [mbs, s] on stage 0, else the
    previous stage's hidden states [mbs, s(/tp), h] received from its pp rank."""
    if stage == 0:
        return ids
    mesh, c = engine.mesh, engine.chunks[0].model.config
    seq = ids.shape[1] // (mesh.tp_size if c.sequence_parallel else 1)
    hidden = torch.empty(ids.shape[0], seq, c.hidden_size, device=mesh.device)
    dist.recv(hidden, src=_pp_rank_of(engine, (stage - 1) % mesh.pp_size), group=mesh.pp_group)
    return hidden


def _broadcast_last(engine: Engine, out: Tensor | None) -> Tensor:
    """The last stage's output (float32, any shape) on every rank of the pp group: shape, then data."""
    mesh = engine.mesh
    if mesh.pp_size == 1:
        return out.float()
    src = _pp_rank_of(engine, (engine.num_stages - 1) % mesh.pp_size)
    ndim = torch.tensor([out.dim() if out is not None else 0], device=mesh.device)
    dist.broadcast(ndim, src=src, group=mesh.pp_group)
    shape = torch.tensor(out.shape if out is not None else [0] * int(ndim), dtype=torch.long, device=mesh.device)
    dist.broadcast(shape, src=src, group=mesh.pp_group)
    data = out.float().contiguous() if out is not None else torch.empty(shape.tolist(), device=mesh.device)
    dist.broadcast(data, src=src, group=mesh.pp_group)
    return data


def forward_only(engine: Engine, batch: dict[str, Tensor], *, logits: bool = False) -> list[tuple[Tensor, ...]]:
    """The last stage's model outputs (float32) for each of this dp rank's ``engine.m`` micro-batches,
    on every rank of the pp group (and the same on the tp ranks): one tuple per micro-batch.

    ``batch`` is a global batch as ``train_step`` takes it (input_ids [G, s], labels, BERT's extras).
    ``logits=False``: the model's losses given the labels, one per label key of ``LOSS_LABELS`` in
    the batch: per-token losses [mbs, s] (GPT, BERT MLM), then BERT's per-pair sentence-order losses
    [mbs] when ``next_sentence_label`` is given; per-example losses [mbs] for sequence classification.
    ``logits=True``: the labels are withheld and the tuple holds the logits, [mbs, s, V] or
    [mbs, num_labels].
    """
    mesh = engine.mesh
    ids, extras = engine._feeds(batch)
    for e in extras:
        e.pop("counts")
        if logits:
            for key in LOSS_LABELS:
                e.pop(key, None)
    returned = 1 if logits else sum(key in batch for key in LOSS_LABELS)  # outputs of the last stage
    modes = [chunk.training for chunk in engine.chunks]
    autocast = (torch.autocast(mesh.device.type, dtype=AUTOCAST[engine.config.precision])
                if engine.config.precision in AUTOCAST else nullcontext())
    last = engine.num_stages - 1
    outputs = []
    try:
        for chunk in engine.chunks:
            chunk.eval()
        with torch.no_grad(), autocast:
            for x, extra in zip(ids, extras):
                out: tuple[Tensor, ...] = (None,) * returned
                for stage in range(mesh.pp_rank, engine.num_stages, mesh.pp_size):
                    # stages of other pp ranks in between are theirs to run; ours wait in recv
                    y = engine.chunks[stage // mesh.pp_size].model(_stage_input(engine, stage, x), **extra)
                    if stage < last:
                        dist.send(y.float().contiguous(), dst=_pp_rank_of(engine, (stage + 1) % mesh.pp_size),
                                  group=mesh.pp_group)
                    else:
                        out = y if isinstance(y, tuple) else (y,)
                outputs.append(tuple(_broadcast_last(engine, o) for o in out))
    finally:
        for chunk, mode in zip(engine.chunks, modes):
            chunk.train(mode)
    return outputs


def gather_dp(engine: Engine, outputs: list[tuple[Tensor, ...]]) -> Tensor:
    """This dp rank's micro-batch outputs (the first of each tuple, [mbs, ...]) -> the whole global batch's [G, ...], in
    batch order (dp rank d holds rows [d G/dp, (d+1) G/dp)), on every rank."""
    local = torch.cat([out[0] for out in outputs])
    parts = [torch.empty_like(local) for _ in range(engine.mesh.dp_size)]
    dist.all_gather(parts, local, group=engine.mesh.dp_group)
    return torch.cat(parts)


def eval_losses(engine: Engine, batch: dict[str, Tensor]) -> tuple[float, dict[str, float]]:
    """The global-batch mean loss as ``train_step`` reports it (for each label key, its part: the sum of
    its losses / its non-ignored count in the global batch; the parts added up: BERT's MLM +
    sentence-order loss), and the parts by label key, without updating anything: the same numbers on
    every rank and mesh (one all-reduce over dp of [1 + K] numbers)."""
    counts = [n.to(engine.mesh.device) for n in label_counts(batch)]
    parts = [[o.sum() / n for o, n in zip(out, counts)] for out in forward_only(engine, batch)]  # [m][K]
    total = torch.stack([sum(p) for p in parts]).sum()
    return reduce_losses(total, torch.stack([torch.stack(p) for p in parts]).sum(0), loss_keys(batch),
                         [engine.mesh.dp_group])


def eval_loss(engine: Engine, batch: dict[str, Tensor]) -> float:
    """The global-batch mean loss of ``eval_losses``, the parts added up."""
    return eval_losses(engine, batch)[0]


def eval_logits(engine: Engine, batch: dict[str, Tensor]) -> Tensor:
    """The logits of the whole global batch on every rank: [G, num_labels] for a sequence classifier,
    [G, s, V] for a language model."""
    return gather_dp(engine, forward_only(engine, batch, logits=True))
