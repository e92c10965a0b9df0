"""How a run is laid out and computes, as run configuration sections: the mesh and its options (``ParallelConfig``,
Megatron-LM's ``--tensor-model-parallel-size`` ...), precision and tpzoo's speed options (``PrecisionConfig``), and
Megatron-LM's speed flags (``SpeedConfig``; ``tpzoo.training.architecture_args.resolve_speed`` maps them onto
tpzoo's before the sections are made). All of them belong to one launch: a resume never restores them. They make
the ``tpzoo.parallel.ParallelPlan`` (``plan_of``). Imports without torch.

    parallel, precision, speed = (section_of(c, flags) for c in (ParallelConfig, PrecisionConfig, SpeedConfig))
    plan = plan_of(parallel, precision, speed, seed, parallel.mesh())
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from tpzoo.engine.config import SCHEDULES
from tpzoo.fields import at_least, boolean, check_fields, one_of, option, optional, positive_number, toggle
from tpzoo.run_options import (ATTENTION_BACKENDS, CP_COMM_TYPES, KERNEL_BACKENDS, RECOMPUTE_GRANULARITIES,
                               RECOMPUTE_METHODS)

if TYPE_CHECKING:
    from tpzoo.parallel import ParallelMesh, ParallelPlan

# the dynamic fp16 loss scale's flags when not given: Megatron's, but for the initial scale, 2^16
# (torch's GradScaler's) instead of Megatron's 2^32: fp16's largest number is 65504, so a larger start
# only skips the first steps (17 from 2^32 at hysteresis 2) on overflows that halve it down
LOSS_SCALE_DEFAULTS = dict(initial_loss_scale=2.0**16, min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2)
LOSS_SCALE_FLAGS = ("loss_scale", *LOSS_SCALE_DEFAULTS)
# the --no-*-fusion flags of the fusions tpzoo's kernels do (--kernels torch turns them off; SpeedConfig)
KERNEL_FUSIONS = ("masked_softmax", "bias_gelu")


def _launch(default: object, check: object, doc: str, flag: str | tuple[str, ...], metavar: str | None = None,
            **role: object) -> object:
    return option(default, check, doc, flag, metavar, launch=True, **role)


@dataclass(frozen=True)
class ParallelConfig:
    """The mesh (tp x pp x dp x cp = world size; dp inferred when None) and how the model and state spread over
    it."""

    tp: int = _launch(1, at_least(1), "", ("--tensor-model-parallel-size", "--tp"))
    pp: int = _launch(1, at_least(1), "", ("--pipeline-model-parallel-size", "--pp"))
    dp: int | None = _launch(None, optional(at_least(1)), "default: world size / (tp x pp x cp)",
                             ("--data-parallel-size", "--dp"))
    cp: int = _launch(1, at_least(1), "each sequence split over cp ranks, its attention by --cp-comm-type (causal "
                      "models: 2 cp chunks, rank r holding chunks r and 2cp-1-r; docs/parallelism.md)",
                      ("--context-parallel-size", "--cp"))
    cp_comm_type: str = _launch("p2p", one_of(*CP_COMM_TYPES), "at cp > 1: p2p, ring attention (keys and values "
                                "passed round the cp ranks); a2a, all-to-all over heads (DeepSpeed-Ulysses: the "
                                "heads must divide by tp x cp)", "--cp-comm-type")
    vpp: int | None = _launch(None, optional(at_least(1)), "model chunks per pp rank (interleaved schedules; "
                              "default: 2 for them)", ("--virtual-pipeline-model-parallel-size", "--vpp"))
    ep: int = _launch(1, at_least(1), "a mixture of experts' experts split over groups of ep dp ranks, tokens sent to "
                      "them by all-to-all (it divides dp and the experts; docs/moe.md)",
                      ("--expert-model-parallel-size", "--ep"))
    pipeline_schedule: str = _launch("1f1b", one_of(*SCHEDULES), "", "--pipeline-schedule")
    sequence_parallel: bool = _launch(False, boolean, "", "--sequence-parallel")
    use_distributed_optimizer: bool = _launch(False, boolean, "ZeRO-2 over dp: optimizer state and main weights "
                                              "sharded, gradients reduce-scattered to their owner",
                                              "--use-distributed-optimizer")
    use_torch_fsdp2: bool = _launch(False, boolean, "weights, gradients and optimizer state sharded over dp by torch's "
                                    "FSDP2 (ZeRO-3), each layer gathered for its forward and backward; needs dp > 1",
                                    "--use-torch-fsdp2")
    num_distributed_optimizer_instances: int = _launch(1, at_least(1), "with --use-torch-fsdp2: HSDP, each weight "
                                                       "sharded over dp / N ranks and replicated over N groups of "
                                                       "them (the replicas all-reduce their gradient shards)",
                                                       "--num-distributed-optimizer-instances", "N")
    elastic: bool = _launch(False, boolean, "torchrun's elastic launches (--nnodes MIN:MAX): dp from each launch's "
                            "world size, the largest the global batch allows (tp, pp, cp kept; spare ranks idle); with "
                            "--save DIR --load DIR a restart resumes at the new mesh (docs/elastic.md)", "--elastic")
    fault_tolerance: bool = _launch(False, boolean, "per-step fault tolerance (torchft): this launch is replica group "
                                    "--ft-replica-id of --ft-replica-groups, each a whole mesh; a group that fails "
                                    "drops out of the steps, one that returns copies a live group's state "
                                    "($TORCHFT_LIGHTHOUSE: the lighthouse; docs/elastic.md)", "--fault-tolerance")
    ft_replica_id: int = _launch(0, at_least(0), "with --fault-tolerance: this launch's replica group I, taking "
                                 "rows I/N of each global batch", "--ft-replica-id", "I")
    ft_replica_groups: int = _launch(1, at_least(1), "with --fault-tolerance: the replica groups N",
                                     "--ft-replica-groups", "N")
    ft_min_replicas: int = _launch(1, at_least(1), "with --fault-tolerance: the fewest live groups a step updates with",
                                   "--ft-min-replicas", "M")
    distributed_timeout_minutes: float = _launch(10.0, positive_number, "a collective waiting this long on a peer "
                                                 "fails; every rank then exits naming the stuck or dead ones",
                                                 "--distributed-timeout-minutes")
    local_rank: int | None = _launch(None, optional(at_least(0)), "this process's rank on its node, as "
                                     "torch.distributed.launch passes it (torchrun sets LOCAL_RANK instead); must "
                                     "agree with LOCAL_RANK", "--local-rank")

    def __post_init__(self) -> None:
        """--use-torch-fsdp2's misuse (the engine's ``tpzoo.engine.fsdp_params.check_fsdp`` says why): with
        --use-distributed-optimizer (FSDP shards the optimizer state already; Megatron refuses the pair too), with
        the interleaved-zero-bubble schedule at pp > 1."""
        check_fields(self)
        if self.elastic and self.dp is not None:
            raise ValueError(f"--elastic takes dp from each launch's world size, but --data-parallel-size is "
                             f"{self.dp}; drop --data-parallel-size")
        self.check_fault_tolerance()
        replicas = self.num_distributed_optimizer_instances
        if replicas > 1 and (not self.use_torch_fsdp2 or self.cp > 1 or self.ep > 1):
            raise ValueError(f"--num-distributed-optimizer-instances {replicas}: tpzoo replicates FSDP's shards (HSDP) "
                             f"with --use-torch-fsdp2, at cp 1 and ep 1 only (cp {self.cp}, ep {self.ep}); add "
                             f"--use-torch-fsdp2 or drop it")
        if self.cp > 1 and self.ep > 1:
            raise ValueError(f"--context-parallel-size {self.cp} with --expert-model-parallel-size {self.ep}: tpzoo "
                             f"does not combine the two yet; drop one")
        if self.use_torch_fsdp2 and self.use_distributed_optimizer:
            raise ValueError("--use-torch-fsdp2 already shards the optimizer state over dp; drop "
                             "--use-distributed-optimizer or --use-torch-fsdp2")
        if self.use_torch_fsdp2 and self.pp > 1 and self.pipeline_schedule == "interleaved-zero-bubble":
            raise ValueError(f"--use-torch-fsdp2 cannot run --pipeline-schedule interleaved-zero-bubble at pp "
                             f"{self.pp} (its split weight gradients miss FSDP's gathered weights); use "
                             f"interleaved-1f1b or drop --use-torch-fsdp2")

    def check_fault_tolerance(self) -> None:
        """--ft-* without --fault-tolerance, a group index or minimum beyond the groups, with --elastic."""
        ft = {"--ft-replica-id": (self.ft_replica_id, 0), "--ft-replica-groups": (self.ft_replica_groups, 1),
              "--ft-min-replicas": (self.ft_min_replicas, 1)}
        given = [f"{flag} {value}" for flag, (value, default) in ft.items() if value != default]
        if not self.fault_tolerance:
            if given:
                raise ValueError(f"{', '.join(given)} without --fault-tolerance; add --fault-tolerance or drop them")
            return
        if self.ft_replica_id >= self.ft_replica_groups or self.ft_min_replicas > self.ft_replica_groups:
            raise ValueError(f"--ft-replica-id {self.ft_replica_id} and --ft-min-replicas {self.ft_min_replicas} must "
                             f"be below and at most --ft-replica-groups {self.ft_replica_groups}")
        if self.elastic:
            raise ValueError("--fault-tolerance with --elastic: a replica group goes on without restarting, so there "
                             "is no new mesh to take; drop one of them")

    def mesh(self) -> ParallelMesh:
        """``init_mesh`` of these sizes (ep included) and timeout: collective, starts the process group if none is."""
        from tpzoo.parallel import init_mesh

        return init_mesh(self.tp, self.pp, self.dp, cp=self.cp, ep=self.ep,
                         dp_replicate=self.num_distributed_optimizer_instances, timeout=self.timeout)

    @property
    def timeout(self) -> timedelta:
        """--distributed-timeout-minutes: the timeout of every process group (``init_mesh(timeout=)``)."""
        return timedelta(minutes=self.distributed_timeout_minutes)

    def check_launch(self) -> None:
        """What needs the launcher's environment: FSDP with dp 1 (nothing to shard over; sizes that do not divide
        the world size are left to ``init_mesh``, which names them), --fault-tolerance without torchft or its
        lighthouse's address, and --local-rank (torch.distributed.launch's), set as LOCAL_RANK when the launcher did
        not, a ValueError naming both when they differ."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dp = self.dp or world // (self.tp * self.pp * self.cp)
        if dp % self.ep and not self.elastic:  # an elastic dp is chosen for ep (tpzoo.training.elastic)
            raise ValueError(f"--expert-model-parallel-size {self.ep} must divide the data-parallel size {dp} (world "
                             f"size {world}, tp {self.tp}, pp {self.pp}): the expert ranks are carved out of dp; "
                             f"choose an ep dividing {dp}")
        if dp % self.num_distributed_optimizer_instances and not self.elastic:
            raise ValueError(f"--num-distributed-optimizer-instances {self.num_distributed_optimizer_instances} must "
                             f"divide the data-parallel size {dp} (world size {world}, tp {self.tp}, pp {self.pp}); "
                             f"choose a divisor of {dp}")
        if self.use_torch_fsdp2 and dp * self.cp == 1:
            raise ValueError(f"--use-torch-fsdp2 shards over dp, but dp is 1 (world size {world}, tp {self.tp}, "
                             f"pp {self.pp}): nothing to shard over; drop --use-torch-fsdp2 or launch more ranks")
        if self.fault_tolerance and importlib.util.find_spec("torchft") is None:
            raise ValueError("--fault-tolerance runs on torchft, which is not installed; pip install 'tpzoo[fault]'")
        if self.fault_tolerance and not os.environ.get("TORCHFT_LIGHTHOUSE"):
            raise ValueError("--fault-tolerance needs the lighthouse's address in $TORCHFT_LIGHTHOUSE (start one with "
                             "torchft_lighthouse --min_replicas 1; docs/elastic.md)")
        if self.local_rank is not None:
            launcher = os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
            if int(launcher) != self.local_rank:
                raise ValueError(f"--local-rank {self.local_rank} differs from the launcher's LOCAL_RANK {launcher}; "
                                 f"drop --local-rank (torchrun sets LOCAL_RANK)")


def _fp16(doc: str, flag: str, check: object = optional(at_least(1)), metavar: str | None = None) -> object:
    return option(None, check, f"fp16: {doc}", flag, metavar)


@dataclass(frozen=True)
class PrecisionConfig:
    """--bf16/--fp16, fp16's loss scale (Megatron's flags; None until given: refused without --fp16, else
    ``LOSS_SCALE_DEFAULTS``) and tpzoo's speed options."""

    bf16: bool = option(False, boolean, "bf16 weights and grads, fp32 main weights", "--bf16", exclusive="dtype",
                        together=("fp16", *LOSS_SCALE_FLAGS))  # --bf16 on an fp16 run: its loss scale stays behind
    fp16: bool = option(False, boolean, "fp16 weights and grads, fp32 main weights, loss scaling", "--fp16",
                        exclusive="dtype", together=("bf16",))
    loss_scale: float | None = _fp16("a static loss scale (an overflow still skips its step); default: dynamic, the "
                                     "flags below", "--loss-scale", optional(positive_number))
    initial_loss_scale: float | None = _fp16(f"the dynamic loss scale to start from (default: "
                                             f"{LOSS_SCALE_DEFAULTS['initial_loss_scale']:g})", "--initial-loss-scale",
                                             optional(positive_number))
    min_loss_scale: float | None = _fp16(f"the dynamic scale never backs off below this (default: "
                                         f"{LOSS_SCALE_DEFAULTS['min_loss_scale']:g})", "--min-loss-scale",
                                         optional(positive_number))
    loss_scale_window: int | None = _fp16(f"clean steps in a row before the scale doubles (default: "
                                          f"{LOSS_SCALE_DEFAULTS['loss_scale_window']})", "--loss-scale-window")
    hysteresis: int | None = _fp16(f"overflows since the scale last grew before it halves (default: "
                                   f"{LOSS_SCALE_DEFAULTS['hysteresis']})", "--hysteresis")
    recompute_activations: bool = _launch(False, boolean, "recompute each layer in backward", "--recompute-activations")
    kernels: str = _launch("auto", one_of(*KERNEL_BACKENDS), "", "--kernels")
    attention_backend: str = _launch("auto", one_of(*ATTENTION_BACKENDS), "", "--attention-backend")
    compile: bool = _launch(False, boolean, "torch.compile each layer and the loss head (backend: "
                            "$TPZOO_COMPILE_BACKEND, inductor if unset; docs/training.md); off unless given: its "
                            "speed-up is not yet measured on a GPU", "--compile")

    def __post_init__(self) -> None:
        check_fields(self)
        scaling = [f"--{name.replace('_', '-')}" for name in LOSS_SCALE_FLAGS if getattr(self, name) is not None]
        if scaling and not self.fp16:
            raise ValueError(f"{', '.join(scaling)} set the fp16 loss scale, but this run is {self.precision}; add "
                             f"--fp16 or drop them")

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def loss_scaling(self) -> dict[str, float]:
        """``EngineConfig``'s loss-scale fields: fp16's, those not given Megatron's (``LOSS_SCALE_DEFAULTS``)."""
        if not self.fp16:
            return {}
        given = {k: getattr(self, k) for k in LOSS_SCALE_FLAGS if getattr(self, k) is not None}
        return {**LOSS_SCALE_DEFAULTS, **given}


@dataclass(frozen=True)
class SpeedConfig:
    """Megatron-LM's speed flags (docs/training.md): what tpzoo does of them, or that it does it already."""

    use_flash_attn: bool = toggle("= --attention-backend sdpa (torch's fused attention)", "--use-flash-attn",
                                  launch=True)
    overlap_grad_reduce: bool = toggle("accepted: tpzoo's data-parallel gradient reduce always overlaps backward",
                                       "--overlap-grad-reduce", launch=True)
    overlap_param_gather: bool = toggle("with --use-torch-fsdp2 only: FSDP gathers each unit's weights ahead of "
                                        "its compute", "--overlap-param-gather", launch=True)
    recompute_granularity: str | None = _launch(None, optional(one_of(*RECOMPUTE_GRANULARITIES)), "full: whole "
                                                "layers (by --recompute-method); selective: core attention only",
                                                "--recompute-granularity")
    recompute_method: str | None = _launch(None, optional(one_of(*RECOMPUTE_METHODS)), "full recompute: uniform "
                                           "(groups of --recompute-num-layers layers) or block (the first N layers "
                                           "of each pipeline stage)", "--recompute-method")
    recompute_num_layers: int | None = _launch(None, optional(at_least(1)), "", "--recompute-num-layers")
    no_masked_softmax_fusion: bool = toggle("= --kernels torch", "--no-masked-softmax-fusion", launch=True)
    no_bias_gelu_fusion: bool = toggle("= --kernels torch", "--no-bias-gelu-fusion", launch=True)
    no_bias_swiglu_fusion: bool = toggle("accepted: tpzoo has no such fusion", "--no-bias-swiglu-fusion", launch=True)
    no_bias_dropout_fusion: bool = toggle("accepted: tpzoo has no such fusion", "--no-bias-dropout-fusion", launch=True)
    no_rope_fusion: bool = toggle("accepted: tpzoo has no such fusion", "--no-rope-fusion", launch=True)
    no_gradient_accumulation_fusion: bool = toggle("accepted: tpzoo has no such fusion",
                                                   "--no-gradient-accumulation-fusion", launch=True)
    no_persist_layer_norm: bool = toggle("accepted: tpzoo's layer norm kernel is not a persistent one",
                                         "--no-persist-layer-norm", launch=True)
    moe_grouped_gemm: bool = toggle("each layer's experts as one grouped multiply (torch._grouped_mm), not a loop "
                                    "over them: the same numbers, no token count read on the host",
                                    "--moe-grouped-gemm", launch=True)
    moe_token_dispatcher_type: str = _launch("alltoall", one_of("alltoall"), "tokens reach the experts of other ranks "
                                             "by all-to-all over the ep group (tpzoo's dispatch; docs/moe.md)",
                                             "--moe-token-dispatcher-type")

    def recompute(self) -> dict[str, object]:
        """The plan's recompute options (checked by ``resolve_speed`` and the plan)."""
        return dict(recompute_granularity=self.recompute_granularity, recompute_method=self.recompute_method,
                    recompute_num_layers=self.recompute_num_layers)


def plan_of(parallel: ParallelConfig, precision: PrecisionConfig, speed: SpeedConfig, seed: int,
            mesh: ParallelMesh) -> ParallelPlan:
    """The ``ParallelPlan`` of ``mesh`` and the sections (``seed``: the weights'). --compile where torch.compile
    cannot run here (``tpzoo.models.compile.compile_problem``) is a ValueError."""
    from tpzoo.parallel import ParallelPlan

    if precision.compile:
        from tpzoo.models.compile import compile_problem

        problem = compile_problem(mesh.device)
        if problem:
            raise ValueError(f"--compile: {problem}")
    return ParallelPlan(mesh, sequence_parallel=parallel.sequence_parallel,
                        recompute_activations=precision.recompute_activations, kernels=precision.kernels,
                        attention_backend=precision.attention_backend, seed=seed, compile=precision.compile,
                        fsdp=parallel.use_torch_fsdp2, grouped_gemm=speed.moe_grouped_gemm,
                        cp_comm_type=parallel.cp_comm_type, **speed.recompute())
