"""Pipeline stages: cut a ``StagedModel`` into chunks, wrap them for ``torch.distributed.pipelining``,
pick the schedule, and keep the tied word embedding of the first and last stage in step.

Chunk c of pp rank r is pipeline stage ``r + c x pp`` (the layout interleaved schedules expect):

    pp=2, virtual_stages=2, 8 layers:   rank 0: stage 0 (embedding, 0-1), stage 2 (4-5)
                                        rank 1: stage 1 (2-3),            stage 3 (6-7, head)

What torch's schedules cannot carry, and how: they pass tensors from stage to stage and hand the
step's extra inputs to the first stage only, but every stage needs BERT's attention mask and the
last needs the labels. Every rank holds the whole global batch (it is cheap to read), so each
``StageModule`` is fed its micro-batches' extras (mask, token types, labels) before the step and
takes the next one on each forward: every schedule runs a stage's forwards in micro-batch order
(checked: ``StageModule.finish`` fails if a stage ran a different number). Tensor parallelism
inside a stage needs nothing: the activations crossing stages are the same on the tp ranks
([b, s, h], or [b, s/tp, h] with sequence parallelism, each tp rank sending its own shard to the
same tp rank of the next stage over its pp group).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from tpzoo.engine.config import EngineConfig
from tpzoo.models.base import StagedModel
from tpzoo.parallel import ParallelMesh

# the label keys of a batch, in the order a model returns their per-element losses when given them
# (BERT: per-token MLM loss [b, s], per-sequence binary-head loss [b]); each is divided by its global count
LOSS_LABELS = ("labels", "next_sentence_label")

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "interleaved-zero-bubble": ScheduleInterleavedZeroBubble,
}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: gloo sends only contiguous tensors, and
    the zero-bubble schedules send a stage's input gradient as autograd left it (with sequence
    parallelism a reduce-scatter's [b, s/tp, h] view of a [s/tp, b, h] buffer). The forward copies:
    those schedules detach a stage's output in place, which fails on a view of the input (a stage
    with no layers)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


class StageModule(nn.Module):
    """One pipeline stage: hidden [b, s(/tp), h] (token ids [b, s] on the first stage) -> hidden, or on
    the last stage this micro-batch's share of the loss [1]: for each label key of ``LOSS_LABELS`` in
    the batch, its part sum(its per-element losses) / (its non-ignored count in the global batch), the
    parts added up. ``parts`` [K] sums the step's parts so far, detached (None before the first)."""

    def __init__(self, model: StagedModel) -> None:
        super().__init__()
        self.model = model
        self.feed: list[dict[str, Tensor]] = []
        self.calls = 0
        self.parts: Tensor | None = None

    def start(self, feed: list[dict[str, Tensor]]) -> None:
        """The extras of the step's micro-batches, in order (the labels and their global ``counts``, one
        per label key present, are read by the last stage)."""
        self.feed, self.calls, self.parts = feed, 0, None

    def finish(self) -> None:
        if self.calls != len(self.feed):
            raise RuntimeError(f"pipeline stage ran {self.calls} forwards for {len(self.feed)} micro-batches")

    def forward(self, x: Tensor) -> Tensor:
        extras = dict(self.feed[self.calls])
        self.calls += 1
        counts = extras.pop("counts")
        out = self.model(x if not x.is_floating_point() else _ContiguousGrad.apply(x), **extras)
        if not self.model.post_process:
            return out.contiguous()
        losses = out if isinstance(out, tuple) else (out,)
        if len(losses) != len(counts):
            raise ValueError(f"{type(self.model).__name__} returned {len(losses)} losses for the {len(counts)} label "
                             f"keys of the batch ({', '.join(k for k in LOSS_LABELS if k in extras)}); it must return "
                             f"one per-element loss per label key")
        parts = [loss.sum() / n for loss, n in zip(losses, counts)]
        detached = torch.stack(parts).detach().float()
        self.parts = detached if self.parts is None else self.parts + detached
        return sum(parts).reshape(1)  # [1]: torch concatenates these


def build_chunks(build: Callable[..., StagedModel], layers: list[range], mesh: ParallelMesh) -> list[StageModule]:
    """This rank's stages: ``build(pre_process=, post_process=, layers=)`` for stages r, r + pp, ..."""
    last = len(layers) - 1
    return [StageModule(build(pre_process=i == 0, post_process=i == last, layers=layers[i]))
            for i in range(mesh.pp_rank, len(layers), mesh.pp_size)]


def build_schedule(chunks: list[StageModule], num_stages: int, config: EngineConfig, m: int, mesh: ParallelMesh,
                   seq_length: int, loss_fn: Callable[[Tensor, Tensor], Tensor]):
    """The schedule over this rank's chunks, for micro-batches of ``seq_length`` tokens.

    Shapes are given (static mode): without them torch infers them by running an extra forward and
    backward of the first micro-batch, which would consume a micro-batch's extras here. Stages send
    float32 hidden states [mbs, s(/tp), h] (the residual stream stays float32 under autocast).
    ``scale_grads=False``: each micro-batch's loss is already divided by the global token count, so
    the gradients must add up, not be averaged over micro-batches.
    """
    mbs, c = config.micro_batch_size, chunks[0].model.config
    hidden = torch.empty(mbs, seq_length // (mesh.tp_size if c.sequence_parallel else 1), c.hidden_size,
                         device="meta", requires_grad=True)  # the received input needs its gradient
    stages = []
    for i, chunk in enumerate(chunks):
        index = mesh.pp_rank + i * mesh.pp_size
        inputs = torch.empty(mbs, seq_length, dtype=torch.long, device="meta") if index == 0 else hidden
        last = index == num_stages - 1
        outputs = torch.empty(1, device="meta") if last else hidden
        stages.append(PipelineStage(chunk, index, num_stages, mesh.device, input_args=inputs, output_args=outputs,
                                    input_grads=None if index == 0 else hidden, output_grads=None if last else hidden,
                                    group=mesh.pp_group))
    cls = SCHEDULE_CLASSES[config.schedule]
    return cls(stages[0] if len(stages) == 1 else stages, m, loss_fn=loss_fn, scale_grads=False)


class TiedEmbeddingSync:
    """Sums the gradients of ``pp_shared`` parameters (the word embedding on the first stage and its
    copy in the last stage's head) over {first stage, last stage}, one group per (dp, tp) coordinate.

    Every rank makes every group, in the same order (``new_group`` is collective); with pp = 1 there
    is nothing to do.
    """

    def __init__(self, chunks: list[StageModule], mesh: ParallelMesh, config: EngineConfig) -> None:
        self.params = [p for c in chunks for p in c.parameters() if getattr(p, "pp_shared", False)]
        self.group = None
        if mesh.pp_size == 1:
            return
        ranks = mesh.device_mesh.mesh
        for first, last in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
            group = dist.new_group([first, last], timeout=config.timeout)
            if dist.get_rank() in (first, last):
                self.group = group

    def sync(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.group is None or not grads:
            return
        for g in grads:
            dist.all_reduce(g, group=self.group)
