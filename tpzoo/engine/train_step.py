"""``Engine``: one optimizer step over a global batch on the ``pp x dp x tp`` mesh.

    plan = ParallelPlan(mesh, sequence_parallel=True)           # or a bare mesh: default run options
    engine = Engine(functools.partial(build_model, GPTModel, config), config, EngineConfig(...), plan)
    result = engine.train_step(batch)      # batch: the whole global batch, [G, s] tensors (G: any multiple of
                                           # micro batch x dp, e.g. a ramp-up's; the loss: the mean over it)
    result.loss, result.losses, result.grad_norm, result.skipped
    engine.bad_steps, engine.loss_scale    # skipped steps in a row that count toward a stop; the fp16 scale

The builder makes one pipeline stage: ``build(plan, pre_process=, post_process=, layers=)`` returns a
``tpzoo.models.base.PipelineStage`` with the plan applied (``functools.partial(tpzoo.models.build_model,
GPTModel, config)``, or ``functools.partial(build_model, BertModel, config, add_binary_head=True)``: the
plain model class built piece by piece, each piece split by its sharding plan); the engine reads from the stage
the label keys of its losses (``label_keys``) and the shape it hands the next stage
(``boundary_shape``), nothing from the model config but its layer count.

The step, on every rank:

    1. dp rank d takes sequences [d G/dp, (d+1) G/dp) of the global batch, in m micro-batches (under per-step
       fault tolerance, ``replicas``, those of slot i dp + d of N dp, in replica group i of N);
       N_k = non-ignored entries (!= -100) of label key k (of the model's ``label_keys``) of the whole
       global batch: GPT ``labels`` (tokens), a classifier's ``labels`` (sequences), BERT's ``labels``
       (tokens) and ``next_sentence_label`` (sequences; its binary head)
    2. forward + backward of every micro-batch, each contributing sum_k sum(losses of k) / N_k:
       directly when pp = 1, else through the pipeline schedule (``pipeline.PipelineRunner``), in the
       model's dtype (bf16/fp16 weights: ``mixed_precision``; the fp16 loss is multiplied by the scale);
       each micro-batch's gradients are added into the float32 main grads
    3. main grads summed over dp (``GradReducer``: all-reduced, or under ZeRO-2 reduce-scattered to their
       owners; FSDP: reduce-scattered, each rank keeps its shard), tied embedding over first+last stage (parameters
       marked ``pp_tied``), partial gradients of replicated parameters over tp (marked ``tp_partial``;
       ``param_facts``; local SGD, ``local_sgd_steps``: no sum over dp, each replica's times dp: ``local_sgd``); on
       the first step the replicated gradients are checked against their facts first
       (``replicas.check_replicas``: a sharding plan that misdescribes a parameter stops the run, no update); then,
       under per-step fault tolerance, the gradients and the loss over the live replica groups
       (``fault_tolerance.ReplicaGroups.all_reduce``)
    4. fp16: unscale, and a flag set on every rank if any rank overflowed
    5. the global norm, clipped to ``clip_grad`` (``grads.clip_grad_norm``); NaN on every rank when the
       loss is not finite on any rank (its finiteness rides the norm's all-reduce over tp and pp; the
       loss is already the same over pp and dp, the gradients the same over dp)
    6. the step's one host-device sync: loss, its parts, norm and overflow flag in one ``tolist``
    7. a non-finite norm or an fp16 overflow: skip on every rank (no update; fp16: the scaler's
       schedule, ``loss_scale``); else AdamW on the main weights this rank owns, then
       ``MainParams.publish`` (model weights = main weights, ZeRO's broadcast over dp; nothing under FSDP); local
       SGD's outer step before it, every ``local_sgd_steps`` updates. Before both, under fault tolerance: if the
       replica group's commit says no (a peer failed during the step, too few groups live), this group does not
       update (``committed`` False: the caller takes the step again)

``bad_steps`` counts the skipped steps in a row that are the model's fault, for the caller's stop
(``--max-skipped-steps``): at fp32 and bf16 every skipped step; at fp16 only the overflows taken at the
scaler's minimum (a static scale's overflows all count), the others being the scale's to fix. A step
that updates sets it to 0. Rank 0 logs one warning line per skipped step.

The loss returned is the global-batch mean (plus the binary head's sequence mean), the same number
on every rank and every mesh; ``losses`` holds its part of each label key (BERT: MLM, sentence order),
summed in the same all-reduce over pp and dp as the loss ([1 + K] numbers).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from tpzoo.engine.config import EngineConfig, check_fits, micro_batches
from tpzoo.engine.context_cut import cut_sequences
from tpzoo.engine.data_parallel import GradReducer, build_optimizer
from tpzoo.engine.expert_records import (expert_layers, recorded_loads, recorded_losses, router_means,
                                          sequence_loss_modules, weigh_sequences)
from tpzoo.engine.fault_tolerance import ReplicaGroups
from tpzoo.engine.fsdp_params import FSDPParams, check_fsdp
from tpzoo.engine.grads import clip_grad_norm, count_zero_grads, global_params_norm
from tpzoo.engine.local_sgd import LocalSGD
from tpzoo.engine.loss_scale import loss_scaler
from tpzoo.engine.mixed_precision import DTYPES, MainParams
from tpzoo.engine.pipeline import PipelineRunner, StageModule, TiedEmbeddingSync
from tpzoo.engine.replicas import RTOL, check_replicas
from tpzoo.engine.timers import Timers
from tpzoo.models.base import PipelineStage
from tpzoo.models.config import IGNORE_INDEX, ModelConfig
from tpzoo.models.moe import ROUTER_LOSSES
from tpzoo.parallel import ParallelMesh, ParallelPlan, as_plan, sync_sequence_parallel_grads
from tpzoo.parallel.health import peers_named
from tpzoo.parallel.token_ids import check_token_ids
from tpzoo.run_options import local_sgd_problem

logger = logging.getLogger(__name__)


def label_counts(batch: dict[str, Tensor], keys: list[str]) -> list[Tensor]:
    """Non-ignored labels of the whole global batch, one count per label key of ``keys``: each loss is
    a mean over its own labels (BERT: MLM tokens, then sentence pairs)."""
    return [(batch[k] != IGNORE_INDEX).sum().clamp(min=1).to(torch.float32) for k in keys]


def reduce_losses(total: Tensor, parts: Tensor, groups: list) -> Tensor:
    """[1 + K] float32: the scalar ``total`` and the parts [K] summed over each of ``groups`` in one
    all-reduce (no host sync: ``named_losses`` reads them)."""
    sums = torch.cat([total.reshape(1), parts]).float()
    for group in groups:
        dist.all_reduce(sums, group=group)
    return sums


def named_losses(values: list[float], keys: list[str]) -> tuple[float, dict[str, float]]:
    """(total, {label key: part}) of ``reduce_losses``' numbers, read to the host."""
    loss, *rest = values
    return loss, dict(zip(keys, rest))


@dataclass
class StepResult:
    loss: float          # global-batch mean loss of each label key, added up (before this step's update)
    grad_norm: float     # global gradient norm before clipping (inf/nan on a skipped step)
    skipped: bool        # no update this step: a non-finite loss or gradient norm, or an fp16 overflow
    losses: dict[str, float]  # the part of ``loss`` of each label key (BERT: labels = MLM, next_sentence_label)
    params_norm: float | None = None  # the weights' norm after the step (``Engine.measure_params_norm``)
    num_zeros: int | None = None      # zero entries of the reduced gradients (``Engine.measure_num_zeros``)
    # a mixture of experts' router losses (``tpzoo.models.moe.ROUTER_LOSSES``), per sequence and layer; {}: none
    router_losses: dict[str, float] = field(default_factory=dict)
    # the token slots routed to each expert of each layer over the global batch ([layer][expert]); []: no experts
    expert_tokens: list[list[int]] = field(default_factory=list)
    live_replicas: int | None = None  # replica groups in the step (``Engine.replicas``); None: no fault tolerance
    committed: bool = True            # False: torchft's commit said no (fault tolerance); no update, take it again


class Engine:
    """The chunks of the model this rank holds, the schedule, the reducer and the optimizer.

    ``build(plan, pre_process=, post_process=, layers=)`` makes one pipeline stage of the model (a
    ``PipelineStage``); ``plan``: a ``ParallelPlan`` or a bare mesh (default run options), handed to
    every call. The stages are checked against ``model_config.num_layers`` and the mesh before the
    first call. ``params``: the model parameters of this rank (in the config's precision), ``main``
    their main parameters (``MainParams``: float32, what the optimizer steps). With ``plan.fsdp`` the
    parameters are float32 shards over dp and their own main parameters (``FSDPParams``), and
    ``reducer`` is None (FSDP reduce-scatters the gradients).
    """

    def __init__(self, build: Callable[..., PipelineStage], model_config: ModelConfig, config: EngineConfig,
                 plan: ParallelPlan | ParallelMesh, replicas: ReplicaGroups | None = None) -> None:
        if plan is None:
            raise TypeError("Engine needs a ParallelPlan or a ParallelMesh, got None")
        self.plan, self.config, self.replicas = as_plan(plan), config, replicas
        mesh = self.mesh = self.plan.mesh
        # the rows of the global batch a step gives this rank: dp slot ``slot`` of ``slots`` (of every replica group)
        self.slot, self.slots = replicas.slot(mesh.dp_size, mesh.dp_rank) if replicas else (mesh.dp_rank, mesh.dp_size)
        if replicas is not None and config.local_sgd_steps is not None:
            raise ValueError(f"local SGD (local_sgd_steps={config.local_sgd_steps}) with per-step fault tolerance: "
                             f"the replica groups sum their gradients every step; drop one of them")
        layers = check_fits(config, model_config.num_layers, mesh.pp_size, self.slots)[1]  # G fits the mesh
        if self.plan.fsdp:
            check_fsdp(config, mesh)
        self.vocab_size = model_config.vocab_size
        self.runner = PipelineRunner(build, self.plan, layers, config)
        self.chunks: list[StageModule] = self.runner.chunks
        self.label_keys = self.runner.label_keys
        if not any(list(c.parameters()) for c in self.chunks):
            raise ValueError(f"pp rank {mesh.pp_rank} holds no parameters with stage_layers={config.stage_layers}; "
                             f"give every pp rank's stages at least one layer (or the embedding or head)")
        self.num_stages = len(layers)
        if mesh.ep_size > 1 and getattr(model_config, "num_experts", None) is None:
            raise ValueError(f"expert parallelism ep={mesh.ep_size}, but a {type(model_config).__name__} has no "
                             f"experts to split (no mixture of experts); build the mesh with ep=1 (drop "
                             f"--expert-model-parallel-size)")
        self.reducer: GradReducer | None = None  # FSDP reduce-scatters the gradients itself; local SGD sums none
        self.local_sgd: LocalSGD | None = None
        problem = local_sgd_problem(config.local_sgd_steps, self.plan.fsdp, mesh.ep_size, mesh.cp_size)
        if problem:
            raise ValueError(problem)
        if self.plan.fsdp:
            self.main = FSDPParams(self.chunks, config.precision, mesh)
        else:
            self.main = MainParams([p for c in self.chunks for p in c.parameters()], self.chunks, config.precision,
                                   mesh.dp_cp_group, config.use_distributed_optimizer, mesh.edp_group)
            zero2 = config.use_distributed_optimizer and config.zero_stage == 2  # reduce-scatter to the owners
            if config.local_sgd_steps is not None:  # each replica steps on its own gradients: none summed over dp
                self.local_sgd = LocalSGD(self.main.owned, mesh.dp_group, config.local_sgd_steps, config.outer_lr)
            else:
                self.reducer = GradReducer(self.main.trainable, self.main.trainable_group, config.bucket_mb,
                                           owner=self.main.trainable_owner if zero2 else None)
                if self.reducer.active:
                    self.main.listeners.append(self.reducer.accumulated)
        self.params = [p for c in self.chunks for p in c.parameters()]
        self.sequence_loss_modules = sequence_loss_modules(self.chunks)
        if mesh.cp_size > 1 and self.sequence_loss_modules:
            raise ValueError(f"context parallelism cp={mesh.cp_size} splits each sequence, but a mixture of experts' "
                             f"router losses are means over whole sequences; train a model with experts at cp 1")
        self.balanced = getattr(self.chunks[0].model, "causal", True)  # the load-balanced cut (context_cut)
        self.expert_layers = expert_layers(self.chunks)
        experts = getattr(model_config, "num_experts", None)
        self.load_shape = (model_config.num_layers, experts) if experts else (0, 0)  # the same on every rank
        self.tied = TiedEmbeddingSync(self.main.params, mesh, config)
        self.optimizer = build_optimizer(self.main.owned, config, mesh.device)
        self.scaler = loss_scaler(config)
        self.replicas_checked = False  # the first step checks the replicated gradients (replicas.check_replicas)
        self.skipped_steps = 0  # all skipped steps of this engine
        self.bad_steps = 0      # skipped steps in a row that count toward a stop (see the module's docstring)
        # asked for by the caller (--log-params-norm, --log-num-zeros-in-grad, --timing-log-level): each costs
        # a collective or a device sync per step, so none is done unless asked
        self.measure_params_norm = self.measure_num_zeros = False
        self.timers = Timers()

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def loss_keys(self, batch: dict[str, Tensor]) -> list[str]:
        """The model's label keys present in ``batch``, in order: one loss part each."""
        return [k for k in self.label_keys if k in batch]

    def check_batch(self, batch: dict[str, Tensor]) -> None:
        """IndexError naming the key and the bad values unless ``input_ids`` and the token-level label keys
        (those shaped like ``input_ids``: GPT's and BERT's ``labels``) lie in [0, vocab size), labels also
        -100 (ignored). Sequence-level labels (classes, sentence order) are the model's to check."""
        shape = batch["input_ids"].shape
        check_token_ids(batch["input_ids"], self.vocab_size, "input_ids")
        for key in self.label_keys:
            if key in batch and batch[key].shape == shape:
                check_token_ids(batch[key], self.vocab_size, key, ignore_index=IGNORE_INDEX)

    def micro_batches(self, batch: dict[str, Tensor], *, labels: bool = True, step: bool = False
                      ) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
        """This dp rank's m micro-batches of the global ``batch`` (G sequences, any multiple of micro batch
        x dp: m = G / (mbs x dp), ``config.micro_batches``): token ids [mbs, s] each, and the
        extras every stage reads (mask, token types; the label keys and ``counts``, their non-ignored
        entries in the global batch). ``labels=False``: the label keys are withheld (the model returns
        its logits) and there are no counts. ``step``: a training step's rows, those of this rank's dp slot over
        every replica group (``replicas``; evaluation takes the whole batch in each group)."""
        g, mbs = batch["input_ids"].shape[0], self.config.micro_batch_size
        slot, slots = (self.slot, self.slots) if step else (self.mesh.dp_rank, self.mesh.dp_size)
        m = micro_batches(self.config, slots, self.mesh.pp_size, g)
        if batch["input_ids"].device.type == "cpu":  # once per batch, on the host: the model itself never syncs
            self.check_batch(batch)
        counts = label_counts(batch, self.loss_keys(batch)) if labels else None
        cp = self.mesh.cp_size
        if cp > 1:
            self.check_cp_batch(batch)
        start = slot * (g // slots)
        ids, extras = [], []
        for k in range(m):
            rows = slice(start + k * mbs, start + (k + 1) * mbs)
            mb = {name: t[rows] for name, t in batch.items() if labels or name not in self.label_keys}
            if cp > 1:  # this cp rank's piece of each sequence, and where it sits
                tp_split = self.mesh.tp_size if self.plan.sequence_parallel else 1
                mb = cut_sequences(mb, cp, self.mesh.cp_rank, self.balanced, tp_split)
            mb = {name: t.to(self.mesh.device) for name, t in mb.items()}
            ids.append(mb.pop("input_ids"))
            extras.append({**mb, "counts": counts} if labels else mb)
        return ids, extras

    def check_cp_batch(self, batch: dict[str, Tensor]) -> None:
        """ValueError for a label key of whole sequences (a class: [G]) under context parallelism, where no rank holds
        a whole sequence, unless the model scores it on the rank holding the token it reads (``first_token_labels``:
        BERT's sentence order, read at [CLS])."""
        scored = getattr(self.chunks[0].model, "first_token_labels", ())
        for key in self.loss_keys(batch):
            if batch[key].dim() < 2 and key not in scored:
                raise ValueError(f"context parallelism cp={self.mesh.cp_size} splits each sequence, so no rank holds "
                                 f"the whole sequences that the labels {key!r} {list(batch[key].shape)} are about; "
                                 f"train without them at cp > 1, or at cp 1")

    def _skip(self, loss: float, norm: float, overflow: bool) -> None:
        """Book a step skipped on every rank: the counts, the fp16 schedule, rank 0's warning line."""
        self.skipped_steps += 1
        counts = self.scaler is None or self.scaler.at_minimum  # read before the scale backs off
        self.bad_steps += counts
        if self.scaler is not None:
            self.scaler.update(finite=False)
        if dist.get_rank() == 0:
            what = "fp16 overflow" if overflow else "non-finite loss or gradient norm"
            scale = f", loss scale now {self.loss_scale:g}" if self.scaler is not None else ""
            logger.warning("step skipped on every rank: %s (loss %s, grad norm %s)%s; %d bad steps in a row",
                           what, loss, norm, scale, self.bad_steps)

    def sync_replicas(self) -> None:
        """Local SGD (``config.local_sgd_steps``): the outer step now, if one is due, so that every dp replica holds
        the same weights (``save_checkpoint`` calls it first). Collective over dp; nothing otherwise."""
        if self.local_sgd is not None and self.local_sgd.finish():
            self.main.publish()

    def train_step(self, batch: dict[str, Tensor]) -> StepResult:
        """One optimizer step over ``batch`` (input_ids and the model's extras and label keys: GPT labels;
        BERT token_type_ids, attention_mask, labels, next_sentence_label). One host-device sync."""
        ids, extras = self.micro_batches(batch, step=True)
        main, mesh = self.main, self.mesh
        main.zero_grad()
        weigh_sequences(self.sequence_loss_modules, self.loss_scale / batch["input_ids"].shape[0])
        if self.reducer is not None:
            self.reducer.start(len(ids))
        if self.local_sgd is not None:
            self.local_sgd.begin()
        with peers_named("train_step", mesh, self.config.timeout_s):
            self.timers.start("forward-backward")
            try:
                total, parts = self.runner.run(ids, extras, backward=True, scale=self.loss_scale)
            except BaseException:
                main.abandon_step()
                raise
            main.flush()
            self.timers.stop("forward-backward")
            self.timers.start("grads-sync")
            if self.reducer is not None:
                self.reducer.sync()
            elif self.local_sgd is not None:  # dp x this replica's share: the replicas' mean is the sum over dp
                torch._foreach_mul_([p.grad for p in main.params if p.grad is not None], float(mesh.dp_size))
            self.tied.sync()
            if not self.replicas_checked:  # the first step (with finite gradients): before the tp sum and any update
                self.replicas_checked = check_replicas(
                    [(n, main.main_of(p)) for c in self.chunks for n, p in c.model.named_parameters()], mesh,
                    max(RTOL, 8 * torch.finfo(DTYPES[self.config.precision]).eps))
            for chunk in main.chunks:
                sync_sequence_parallel_grads(chunk, mesh.tp_group)
            self.timers.stop("grads-sync")
            recorded = recorded_losses(self.sequence_loss_modules, mesh.device)
            loads = recorded_loads(self.expert_layers, self.load_shape, mesh.device)
            sums = reduce_losses(total / self.loss_scale, torch.cat([parts, recorded, loads]),
                                 [mesh.pp_group, mesh.dp_cp_group])
            sharded = self.plan.fsdp or self.reducer is not None and self.reducer.sharded
            if self.replicas is not None:  # the gradients this rank steps on, and the loss, over the replica groups
                stepped = main.owned if sharded else main.params
                self.replicas.all_reduce([*(p.grad for p in stepped if p.grad is not None), sums])
            overflow = (self.scaler.unscale(main.params) if self.scaler is not None
                        else torch.zeros((), device=mesh.device))
            norm = clip_grad_norm(main.params, self.config.clip_grad, mesh, loss=sums, dp_sharded=sharded)
            zeros = [count_zero_grads(main.params, mesh, sharded)] if self.measure_num_zeros else []
            numbers = torch.cat([t.reshape(-1).double() for t in (sums, norm, overflow, *zeros)]).tolist()
            *read, norm, overflow = numbers[:len(sums) + 2]
            zeros = numbers[len(sums) + 2:]  # [count] when measured
            read, load = read[:len(read) - loads.numel()], read[len(read) - loads.numel():]
            experts = self.load_shape[1]
            tokens = [[round(v) for v in load[i:i + experts]] for i in range(0, len(load), experts or 1)]
            loss, losses = named_losses(read, self.loss_keys(batch))
            router = router_means(read[-len(ROUTER_LOSSES) - 1:], batch["input_ids"].shape[0], self.slots)
            skipped = bool(overflow) or not math.isfinite(norm)
            live = self.replicas.live if self.replicas is not None else None
            if self.replicas is not None and not self.replicas.commit():  # a peer failed, or too few live
                return StepResult(loss, norm, True, losses, live_replicas=live, committed=False)
            if skipped:
                self._skip(loss, norm, overflow=bool(overflow))
            else:
                if self.scaler is not None:
                    self.scaler.update(finite=True)
                self.bad_steps = 0
                self.timers.start("optimizer")
                self.optimizer.step()
                if self.local_sgd is not None:
                    self.local_sgd.step()  # every H updates: the outer step
                main.publish()
                self.timers.stop("optimizer")
        params_norm = None
        if self.measure_params_norm:  # main weights after the step; ZeRO's and FSDP's are dp shards
            params_norm = global_params_norm(main.owned, mesh, self.plan.fsdp or main.zero).item()
        return StepResult(loss, norm, skipped, losses, params_norm, int(zeros[0]) if zeros else None, router, tokens,
                          live)
