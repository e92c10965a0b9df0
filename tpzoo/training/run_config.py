"""The run configuration: one typed section per concern, made once from a command's resolved flags (``RunConfig.of``)
and handed down, so that nothing below the commands reads the parsed flags.

    job = RunConfig.of(vars(args))              # ValueError naming the field or flag a section refuses
    job.parallel.tp, job.training.lr, job.logging.log_throughput, job.stopping.exit_interval ...
    mesh = job.parallel.mesh()                  # init_mesh of the parallel section
    plan, engine_config = job.plan(mesh), job.engine()

The sections (``SECTIONS``) and their flag groups: ``ParallelConfig`` (parallel), ``PrecisionConfig`` (precision and
speed), ``SpeedConfig`` (Megatron-LM's speed flags) in ``tpzoo.training.parallel_config``; ``TrainingConfig`` (batch
and optimizer) in ``tpzoo.training.optimizer_args``; ``RunIO`` (run) and ``CheckpointConfig`` in
``tpzoo.training.checkpoint_args``; ``LoggingConfig`` in ``tpzoo.training.logging_args``; ``StoppingConfig`` here.
Their flags are generated from them (``tpzoo.fields.add_section``). The model (``ModelChoice``,
``tpzoo.training.model_args``) and the data (``DataConfig``, ``tpzoo.data.data_args``) are made from their flags
too. Imports without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from tpzoo.data.data_args import DataConfig
from tpzoo.engine.config import EngineConfig
from tpzoo.models.families import family
from tpzoo.run_options import context_cut_problem, local_sgd_problem
from tpzoo.fields import (add_section, at_least, boolean, check_fields, option, optional, positive_number, role,
                          section_of)
from tpzoo.training.checkpoint_args import CheckpointConfig, RunIO
from tpzoo.training.logging_args import LoggingConfig
from tpzoo.training.model_args import ModelChoice, check_experts
from tpzoo.training.optimizer_args import TrainingConfig
from tpzoo.training.parallel_config import ParallelConfig, PrecisionConfig, SpeedConfig, plan_of

if TYPE_CHECKING:
    from tpzoo.parallel import ParallelMesh, ParallelPlan

__all__ = ["RunConfig", "SECTIONS", "StoppingConfig", "add_section", "role", "section_of"]


@dataclass(frozen=True)
class StoppingConfig:
    """When a run stops early (Megatron-LM's names; ``tpzoo.training.stopping``)."""

    exit_signal_handler: bool = option(True, boolean, "on SIGTERM or SIGINT finish the step, save and exit 0 (a "
                                       "second Ctrl-C kills)", "--exit-signal-handler", launch=True)
    exit_interval: int | None = option(None, optional(at_least(1)), "save and exit 0 after an iteration divisible by N",
                                       "--exit-interval", "N", launch=True)
    exit_duration_in_mins: float | None = option(None, optional(positive_number), "save and exit 0 once M minutes "
                                                 "have passed since training started", "--exit-duration-in-mins", "M",
                                                 launch=True)
    max_skipped_steps: int = option(10, at_least(1), "exit 1 after N steps in a row skipped for a non-finite loss or "
                                    "gradient norm, or with every gradient zero", "--max-skipped-steps", "N",
                                    launch=True)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class RunConfig:
    """A run's resolved configuration: its typed sections (``SECTIONS``), made once from the resolved flags, and
    those flags by destination (read-only: what a checkpoint and config.toml record)."""

    flags: Mapping[str, Any]
    model: ModelChoice
    data: DataConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    speed: SpeedConfig
    training: TrainingConfig
    io: RunIO
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    stopping: StoppingConfig

    def __post_init__(self) -> None:
        check_experts(self.model, self.parallel.ep, self.speed.moe_grouped_gemm)  # against the model's experts
        p = self.parallel
        problem = local_sgd_problem(self.training.local_sgd_steps, p.use_torch_fsdp2, p.ep, p.cp,
                                    p.use_distributed_optimizer)
        if problem:
            raise ValueError(problem)
        if p.fault_tolerance and self.training.local_sgd_steps is not None:
            raise ValueError(f"--local-sgd-steps {self.training.local_sgd_steps} with --fault-tolerance: the replica "
                             f"groups sum their gradients every step; drop one of them")
        if p.cp > 1 and self.model.model is not None:  # the sequence cut over cp (tpzoo.engine.context_cut)
            problem = context_cut_problem(self.model.seq_length, p.cp, family(self.model.model).data == "causal-lm",
                                          p.tp if p.sequence_parallel else 1)
            if problem:
                raise ValueError(f"--context-parallel-size {p.cp}: {problem} (--seq-length)")

    @classmethod
    def of(cls, flags: Mapping[str, Any]) -> RunConfig:
        """The sections of ``flags`` (a command's resolved flags by destination); ValueError naming the field or
        flag a section refuses."""
        flags = MappingProxyType(dict(flags))
        return cls(flags, ModelChoice.of(flags), DataConfig.of(flags),
                   **{name: section_of(section, flags) for name, section in SECTIONS.items()})

    def plan(self, mesh: ParallelMesh) -> ParallelPlan:
        """The ``tpzoo.parallel.ParallelPlan`` of ``mesh`` (a ``ParallelMesh``) and the sections
        (``tpzoo.training.parallel_config.plan_of``; the weights' seed: ``--seed``)."""
        return plan_of(self.parallel, self.precision, self.speed, self.training.seed, mesh)

    def engine(self, **changes: Any) -> EngineConfig:
        """The ``EngineConfig`` of the training, parallel and precision sections, and ``changes``."""
        t, parallel, precision = self.training, self.parallel, self.precision
        return EngineConfig(**{
            **dict(micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                   schedule=parallel.pipeline_schedule, virtual_stages=parallel.vpp,
                   use_distributed_optimizer=parallel.use_distributed_optimizer, lr=t.lr, weight_decay=t.weight_decay,
                   clip_grad=t.clip_grad, precision=precision.precision, optimizer=t.optimizer,
                   adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, sgd_momentum=t.sgd_momentum,
                   local_sgd_steps=t.local_sgd_steps, outer_lr=t.outer_lr,
                   timeout_s=60.0 * parallel.distributed_timeout_minutes),
            **precision.loss_scaling(), **changes})


# name -> section class, in the order of RunConfig's fields
SECTIONS = dict(parallel=ParallelConfig, precision=PrecisionConfig, speed=SpeedConfig, training=TrainingConfig,
                io=RunIO, checkpoint=CheckpointConfig, logging=LoggingConfig, stopping=StoppingConfig)
