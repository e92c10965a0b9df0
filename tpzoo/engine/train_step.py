"""``Engine``: one optimizer step over a global batch on the ``pp x dp x tp`` mesh.

    engine = Engine(lambda **stage: GPTModel(config, mesh, **stage), config, EngineConfig(...), mesh)
    result = engine.train_step(batch)      # batch: the whole global batch, [G, s] tensors
    result.loss, result.losses, result.grad_norm, result.skipped

The step, on every rank:

    1. dp rank d takes sequences [d G/dp, (d+1) G/dp) of the global batch, in m micro-batches;
       N_k = non-ignored entries (!= -100) of label key k of the whole global batch: ``labels``
       (tokens, or sequences for a classifier), ``next_sentence_label`` (sequences; BERT's binary head)
    2. forward + backward of every micro-batch, each contributing sum_k sum(losses of k) / N_k:
       directly when pp = 1, else through the pipeline schedule (``pipeline``); under bf16 or fp16
       autocast, parameters and gradients stay float32, the fp16 loss is multiplied by the scale
    3. gradients summed over dp (``GradReducer``), tied embedding over first+last stage, sequence-
       parallel LayerNorm gradients over tp
    4. fp16: unscale, skip the step on every rank if any rank overflowed (the scale drops)
    5. clip to ``clip_grad`` by the global norm (``grads.clip_grad_norm``), optimizer step (ZeRO-1 or not)

The loss returned is the global-batch mean (plus the binary head's sequence mean), the same number
on every rank and every mesh; ``losses`` holds its part of each label key (BERT: MLM, sentence order),
summed in the same all-reduce over pp and dp as the loss ([1 + K] numbers).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from tpzoo.engine.config import EngineConfig, check_fits
from tpzoo.engine.data_parallel import GradReducer, build_optimizer
from tpzoo.engine.grads import clip_grad_norm
from tpzoo.engine.loss_scale import DynamicLossScaler
from tpzoo.engine.pipeline import LOSS_LABELS, StageModule, TiedEmbeddingSync, build_chunks, build_schedule
from tpzoo.models.base import StagedModel
from tpzoo.models.config import TransformerConfig
from tpzoo.parallel import ParallelMesh, sync_sequence_parallel_grads
from tpzoo.parallel.health import DEFAULT_WAIT_S, roll_call

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def loss_keys(batch: dict[str, Tensor]) -> list[str]:
    """The label keys of ``LOSS_LABELS`` in ``batch``, in order: one loss part each."""
    return [k for k in LOSS_LABELS if k in batch]


def label_counts(batch: dict[str, Tensor]) -> list[Tensor]:
    """Non-ignored labels of the whole global batch, one count per label key of ``LOSS_LABELS`` present:
    each loss is a mean over its own labels (BERT: MLM tokens, then sentence pairs)."""
    return [(batch[k] != IGNORE_INDEX).sum().clamp(min=1).to(torch.float32) for k in loss_keys(batch)]


def reduce_losses(total: Tensor, parts: Tensor, keys: list[str], groups: list) -> tuple[float, dict[str, float]]:
    """(total, {label key: part}): the scalar ``total`` and the parts [K] summed over each of ``groups``
    in one all-reduce of [1 + K] float32 numbers."""
    sums = torch.cat([total.reshape(1), parts]).float()
    for group in groups:
        dist.all_reduce(sums, group=group)
    loss, *rest = sums.tolist()
    return loss, dict(zip(keys, rest))


@dataclass
class StepResult:
    loss: float          # global-batch mean loss of each label key, added up (before this step's update)
    grad_norm: float     # global gradient norm before clipping (inf/nan on a skipped fp16 step)
    skipped: bool        # fp16 overflow: no update this step
    losses: dict[str, float]  # the part of ``loss`` of each label key (BERT: labels = MLM, next_sentence_label)


class Engine:
    """The chunks of the model this rank holds, the schedule, the reducer and the optimizer.

    ``build(pre_process=, post_process=, layers=)`` makes one pipeline stage of the model (a
    ``StagedModel``); everything is checked against ``config`` and the mesh before it is called.
    """

    def __init__(self, build: Callable[..., StagedModel], model_config: TransformerConfig, config: EngineConfig,
                 mesh: ParallelMesh) -> None:
        self.config, self.mesh = config, mesh
        self.m, layers = check_fits(config, model_config.num_layers, mesh.pp_size, mesh.dp_size)
        self.chunks: list[StageModule] = build_chunks(build, layers, mesh)
        self.params = [p for c in self.chunks for p in c.parameters()]
        if not self.params:
            raise ValueError(f"pp rank {mesh.pp_rank} holds no parameters with stage_layers={config.stage_layers}; "
                             f"give every pp rank's stages at least one layer (or the embedding or head)")
        self.num_stages = len(layers)
        self.schedules: dict[int, object] = {}  # sequence length -> pipeline schedule (pp > 1)
        self.tied = TiedEmbeddingSync(self.chunks, mesh, config)
        self.reducer = GradReducer(self.params, mesh.dp_group, config.bucket_mb)
        self.optimizer = build_optimizer(self.params, config, mesh.dp_group)
        self.scaler = DynamicLossScaler(scale=config.initial_loss_scale) if config.precision == "fp16" else None
        self.skipped_steps = 0

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def _loss_fn(self, loss: Tensor, _target: Tensor) -> Tensor:
        """The last stage's output is already the micro-batch's share of the loss; torch's schedules
        index a target whenever a loss_fn is set, so the labels are passed as one and not read here."""
        return loss.sum() * self.loss_scale

    def _feeds(self, batch: dict[str, Tensor]) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
        """This dp rank's micro-batches: token ids [mbs, s] and the extras every stage reads."""
        g, mbs = self.config.global_batch_size, self.config.micro_batch_size
        if batch["input_ids"].shape[0] != g:
            raise ValueError(f"the batch holds {batch['input_ids'].shape[0]} sequences, the global batch size is {g}")
        counts = label_counts(batch)
        start = self.mesh.dp_rank * (g // self.mesh.dp_size)
        ids, extras = [], []
        for k in range(self.m):
            rows = slice(start + k * mbs, start + (k + 1) * mbs)
            mb = {name: t[rows].to(self.mesh.device) for name, t in batch.items()}
            ids.append(mb.pop("input_ids"))
            extras.append({**mb, "counts": counts})
        return ids, extras

    def _forward_backward(self, ids: list[Tensor], extras: list[dict[str, Tensor]]) -> tuple[Tensor, Tensor]:
        """Sum of this rank's micro-batch losses (scaled), and of their unscaled parts [K] (one per label key):
        nonzero on the last stage only."""
        for chunk in self.chunks:
            chunk.start(extras)
        if self.mesh.pp_size == 1:
            total = torch.zeros((), device=self.mesh.device)
            for x in ids:
                loss = self._loss_fn(self.chunks[0](x), x)
                loss.backward()
                total += loss.detach()
        else:
            losses: list[Tensor] = []
            first = self.mesh.pp_rank == 0
            last = self.mesh.pp_rank == self.mesh.pp_size - 1
            local = torch.cat(ids)
            seq = local.shape[1]
            if seq not in self.schedules:
                self.schedules[seq] = build_schedule(self.chunks, self.num_stages, self.config, self.m, self.mesh,
                                                     seq, self._loss_fn)
            self.schedules[seq].step(*((local,) if first else ()), target=local if last else None,
                                     losses=losses if last else None)
            total = torch.stack(losses).sum().float() if last else torch.zeros((), device=self.mesh.device)
        for chunk in self.chunks:
            chunk.finish()
        parts = next((chunk.parts for chunk in self.chunks if chunk.parts is not None), None)
        return total, parts if parts is not None else torch.zeros(len(extras[0]["counts"]), device=self.mesh.device)

    def train_step(self, batch: dict[str, Tensor]) -> StepResult:
        """One optimizer step over ``batch`` (input_ids, labels, and BERT's token_type_ids, attention_mask,
        next_sentence_label)."""
        ids, extras = self._feeds(batch)
        self.optimizer.zero_grad(set_to_none=True)
        self.reducer.start(self.m)
        autocast = (torch.autocast(self.mesh.device.type, dtype=AUTOCAST[self.config.precision])
                    if self.config.precision in AUTOCAST else nullcontext())
        try:
            with autocast:
                total, parts = self._forward_backward(ids, extras)
            self.reducer.sync()
            self.tied.sync()
            for chunk in self.chunks:
                sync_sequence_parallel_grads(chunk, self.mesh.tp_group)
            loss, losses = reduce_losses(total / self.loss_scale, parts, loss_keys(batch),
                                         [self.mesh.pp_group, self.mesh.dp_group])
            if self.scaler is not None and not self.scaler.unscale_and_check(self.params):
                self.skipped_steps += 1
                if dist.get_rank() == 0:
                    logger.warning("fp16 overflow: step skipped on every rank (%d so far), loss scale now %g",
                                   self.skipped_steps, self.loss_scale)
                return StepResult(loss, float("inf"), True, losses)
            norm = clip_grad_norm(self.params, self.config.clip_grad, self.mesh)
            self.optimizer.step()
        except RuntimeError as e:  # a dead or stuck peer: a roll call names it (see tpzoo.parallel.health)
            who = roll_call(min(DEFAULT_WAIT_S, self.config.timeout_s)).describe(self.mesh)
            raise RuntimeError(f"rank {dist.get_rank()} ({self.mesh!r}) failed in train_step: {who}; {e}") from e
        return StepResult(loss, norm.item(), False, losses)
