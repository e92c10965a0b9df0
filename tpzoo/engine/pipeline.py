"""Pipeline stages: cut a model into chunks, wrap them for ``torch.distributed.pipelining``, pick the
schedule, and keep the tied word embedding of the first and last stage in step.

The engine knows a model only through ``tpzoo.models.base.PipelineStage``: ``build(plan,
pre_process=, post_process=, layers=)`` makes one stage; the stage names the label keys whose
per-element losses its last stage returns (``label_keys``) and the shape of the hidden states it
hands the next stage (``boundary_shape``).

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

``PipelineRunner`` is the one path a step's micro-batches take, training or not: forward and
backward through the schedule (or, with pp = 1, one chunk in a loop), or forward only through the
same schedule (``schedule.eval``: torch runs its forward actions and skips the backward ones).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage as TorchStage,  # tpzoo.models.base.PipelineStage is the model side of a stage
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.mixed_precision import DTYPES
from tpzoo.models.base import PipelineStage
from tpzoo.parallel import ParallelMesh, ParallelPlan
from tpzoo.parallel.fsdp import local, sync_gradients_this_backward
from tpzoo.parallel.param_facts import facts

KEPT_SCHEDULES = 4  # schedules a runner keeps (their stages hold buffers): a ramp-up's many sizes are not all kept
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
    the last stage this micro-batch's share of the loss [1]: for each of the model's ``label_keys`` in
    the batch, its part sum(its per-element losses) / (its non-ignored count in the global batch), the
    parts added up. ``parts`` [K] sums the step's parts so far, detached (None before the first).

    A micro-batch fed without ``counts`` (labels withheld, e.g. for logits) adds nothing: the last
    stage returns 0 [1]. With ``keep``, the last stage also keeps each micro-batch's model outputs
    (detached, float32) in ``kept``, one tuple per micro-batch."""

    def __init__(self, model: PipelineStage) -> None:
        super().__init__()
        self.model = model
        self.feed: list[dict[str, Tensor]] = []
        self.calls = 0
        self.parts: Tensor | None = None
        self.kept: list[tuple[Tensor, ...]] | None = None

    def start(self, feed: list[dict[str, Tensor]], keep: bool = False) -> None:
        """The extras of the step's micro-batches, in order (the labels and their global ``counts``, one
        per label key present, are read by the last stage)."""
        self.feed, self.calls, self.parts, self.kept = feed, 0, None, [] if keep else None

    def finish(self) -> None:
        if self.calls != len(self.feed):
            raise RuntimeError(f"pipeline stage ran {self.calls} forwards for {len(self.feed)} micro-batches")

    def forward(self, x: Tensor) -> Tensor:
        extras = dict(self.feed[self.calls])
        self.calls += 1
        counts = extras.pop("counts", None)
        out = self.model(x if not x.is_floating_point() else _ContiguousGrad.apply(x), **extras)
        if not self.model.post_process:
            return out.contiguous()
        outputs = out if isinstance(out, tuple) else (out,)
        if self.kept is not None:
            self.kept.append(tuple(o.detach().float() for o in outputs))
        if counts is None:
            return torch.zeros(1, device=outputs[0].device)
        if len(outputs) != len(counts):
            keys = ", ".join(k for k in self.model.label_keys if k in extras)
            raise ValueError(f"{type(self.model).__name__} returned {len(outputs)} losses for the {len(counts)} "
                             f"label keys of the batch ({keys}); it must return one per-element loss per label key")
        parts = [loss.sum() / n for loss, n in zip(outputs, counts)]
        detached = torch.stack(parts).detach().float()
        self.parts = detached if self.parts is None else self.parts + detached
        return torch.stack([sum(parts)])  # [1], not a view (FSDP warns of a root output that is one)


def build_chunks(build: Callable[..., PipelineStage], layers: list[range], plan: ParallelPlan) -> list[StageModule]:
    """This rank's stages: ``build(plan, pre_process=, post_process=, layers=)`` for stages r, r + pp, ..."""
    last, mesh = len(layers) - 1, plan.mesh
    chunks = []
    for i in range(mesh.pp_rank, len(layers), mesh.pp_size):
        model = build(plan, pre_process=i == 0, post_process=i == last, layers=layers[i])
        if not isinstance(model, PipelineStage):
            raise TypeError(f"the builder returned a {type(model).__name__}, not a pipeline stage: it needs "
                            f"label_keys, pre_process, post_process, layer_numbers and boundary_shape() "
                            f"(see tpzoo.models.base.PipelineStage)")
        if getattr(model, "plan", None) is not plan:  # a plain model: unsplit, without its parameters' facts
            raise TypeError(f"the builder returned a {type(model).__name__} not built for this plan; build stages "
                            f"with tpzoo.models.build_model (e.g. functools.partial(build_model, cls, config))")
        chunks.append(StageModule(model))
    return chunks


def build_schedule(chunks: list[StageModule], num_stages: int, config: EngineConfig, m: int, plan: ParallelPlan,
                   seq_length: int, loss_fn: Callable[[Tensor, Tensor], Tensor], dtype: torch.dtype):
    """The schedule over this rank's chunks, for micro-batches of ``seq_length`` tokens.

    Shapes are given (static mode): without them torch infers them by running an extra forward and
    backward of the first micro-batch, which would consume a micro-batch's extras here. Stages send
    hidden states of the stage's ``boundary_shape`` ([mbs, s, h]; [mbs, s/tp, h] under the plan's sequence
    parallelism) in the model's ``dtype`` (its
    weights' dtype: float32, bf16 or fp16). ``scale_grads=False``: each micro-batch's loss is already divided
    by the global token count, so the gradients must add up, not be averaged over micro-batches.
    """
    mbs, mesh = config.micro_batch_size, plan.mesh
    shape = chunks[0].model.boundary_shape(mbs, seq_length)
    if plan.sequence_parallel:  # each tp rank sends its slice of the sequence
        shape = (shape[0], shape[1] // mesh.tp_size, *shape[2:])
    hidden = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)  # the received input needs its gradient
    stages = []
    for i, chunk in enumerate(chunks):
        index = mesh.pp_rank + i * mesh.pp_size
        inputs = torch.empty(mbs, seq_length, dtype=torch.long, device="meta") if index == 0 else hidden
        last = index == num_stages - 1
        outputs = torch.empty(1, device="meta") if last else hidden
        stages.append(TorchStage(chunk, index, num_stages, mesh.device, input_args=inputs, output_args=outputs,
                                 input_grads=None if index == 0 else hidden, output_grads=None if last else hidden,
                                 group=mesh.pp_group))
    cls = SCHEDULE_CLASSES[config.schedule]
    return cls(stages[0] if len(stages) == 1 else stages, m, loss_fn=loss_fn, scale_grads=False)


class PipelineRunner:
    """This rank's chunks of the model (``build_chunks``) and the schedules over them, one per sequence
    length and number of micro-batches m (each schedule is built for its m: a batch ramp-up builds one per
    batch size; the ``KEPT_SCHEDULES`` used last are kept, the ramp's current one and evaluation's among them):
    runs a step's micro-batches forward and, when training, backward (see module docstring), in
    the dtype of the model's weights (``dtype``, the config's precision: the engine casts them,
    ``mixed_precision``)."""

    def __init__(self, build: Callable[..., PipelineStage], plan: ParallelPlan, layers: list[range],
                 config: EngineConfig) -> None:
        self.plan, self.mesh, self.config = plan, plan.mesh, config
        self.num_stages = len(layers)
        self.chunks = build_chunks(build, layers, plan)
        self.label_keys: tuple[str, ...] = self.chunks[0].model.label_keys
        self.schedules: dict[tuple[int, int], object] = {}  # (sequence length, m) -> schedule (pp > 1), KEPT_SCHEDULES
        self.scale = 1.0
        self.dtype = DTYPES[config.precision]

    def _loss_fn(self, loss: Tensor, _target: Tensor) -> Tensor:
        """The last stage's output is already the micro-batch's share of the loss; torch's schedules
        index a target whenever a loss_fn is set, so the labels are passed as one and not read here."""
        return loss.sum() * self.scale

    def run(self, ids: list[Tensor], extras: list[dict[str, Tensor]], *, backward: bool, scale: float = 1.0,
            keep: bool = False) -> tuple[Tensor, Tensor]:
        """Forward (and with ``backward`` backward, the losses multiplied by ``scale``) of the micro-batches
        ``ids`` [m x [mbs, s]] with their ``extras``. Returns the sum of this
        rank's micro-batch losses (scaled) and of their unscaled parts [K] (one per label key): nonzero
        on the last stage only. ``keep``: the last stage keeps its outputs (``outputs``)."""
        self.scale = scale
        for chunk in self.chunks:
            chunk.start(extras, keep)
        device = self.mesh.device
        if self.mesh.pp_size == 1:
            total = torch.zeros((), device=device)
            for k, x in enumerate(ids):
                loss = self._loss_fn(self.chunks[0](x), x)
                if backward:
                    sync_gradients_this_backward(self.chunks[0], last=k == len(ids) - 1)
                    loss.backward()
                total += loss.detach()
        else:
            total = self._run_schedule(ids, backward)
        for chunk in self.chunks:
            chunk.finish()
        parts = next((chunk.parts for chunk in self.chunks if chunk.parts is not None), None)
        return total, parts if parts is not None else torch.zeros(len(extras[0].get("counts", ())), device=device)

    def _run_schedule(self, ids: list[Tensor], backward: bool) -> Tensor:
        first, last = self.mesh.pp_rank == 0, self.mesh.pp_rank == self.mesh.pp_size - 1
        local = torch.cat(ids)
        key = (local.shape[1], len(ids))  # a batch ramp-up changes m between steps
        if key in self.schedules:
            schedule = self.schedules.pop(key)
        else:
            schedule = build_schedule(self.chunks, self.num_stages, self.config, key[1], self.plan, key[0],
                                      self._loss_fn, self.dtype)
        self.schedules[key] = schedule  # the most recently used last
        if len(self.schedules) > KEPT_SCHEDULES:
            del self.schedules[next(iter(self.schedules))]
        losses: list[Tensor] = []
        (schedule.step if backward else schedule.eval)(*((local,) if first else ()), target=local if last else None,
                                                       losses=losses if last else None)
        return torch.stack(losses).sum().float() if last else torch.zeros((), device=self.mesh.device)

    def outputs(self) -> list[tuple[Tensor, ...]] | None:
        """The last stage's kept outputs of the last ``run(keep=True)``; None on the ranks without it."""
        return next((chunk.kept for chunk in self.chunks if chunk.model.post_process), None)


class TiedEmbeddingSync:
    """Sums the gradients of ``pp_tied`` parameters (``tpzoo.parallel.param_facts``: the word embedding
    on the first stage and its copy in the last stage's head) over {first stage, last stage}, one group
    per (dp, tp) coordinate.

    Every rank makes every group, in the same order (``new_group`` is collective); with pp = 1 there
    is nothing to do. ``params``: the parameters holding the step's gradients (the main parameters).
    """

    def __init__(self, params: list[nn.Parameter], mesh: ParallelMesh, config: EngineConfig) -> None:
        self.params = [p for p in params if facts(p).pp_tied]
        self.group = None
        if mesh.pp_size == 1:
            return
        ranks = mesh.device_mesh.mesh
        for first, last in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
            group = dist.new_group([first, last], timeout=config.timeout)
            if dist.get_rank() in (first, last):
                self.group = group

    def sync(self) -> None:
        grads = [local(p.grad) for p in self.params if p.grad is not None]  # FSDP: both copies shard alike
        if self.group is None or not grads:
            return
        for g in grads:
            dist.all_reduce(g, group=self.group)
