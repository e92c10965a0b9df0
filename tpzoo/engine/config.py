"""``EngineConfig``: how one optimizer step runs on the ``pp x dp x tp`` mesh, one validated dataclass.

Each field's check sits next to it; ``check_fits`` then ties the config to the mesh and the model
(layers per stage, micro-batches per step) and raises before any work, naming the numbers:

    global_batch_size = micro_batch_size x dp x m           m micro-batches per dp rank and step
                                                            (a step may take another multiple: a batch ramp-up)
    chunks = pp x virtual_stages                            pipeline stages (model chunks)
    units = num_layers (+ 2 when the embedding and head weigh as a layer each)   divisible by chunks
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from tpzoo.fields import at_least, boolean, check_fields, one_of, option, optional, positive_number
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble")
INTERLEAVED = ("interleaved-1f1b", "interleaved-zero-bubble")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd")


def _non_negative(v: object) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"must be a float >= 0, got {type(v).__name__} {v!r}"
    return None if v >= 0 else f"must be >= 0, got {v}"


def _unit(v: object) -> str | None:
    problem = _non_negative(v)
    return problem or (None if v < 1 else f"must be < 1, got {v}")


def _stage_layers(v: object) -> str | None:
    if v is None:
        return None
    if not isinstance(v, tuple) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v):
        return f"must be None or a tuple of ints >= 0 (layers per stage), got {v!r}"
    return None


def _zero_stage(v: object) -> str | None:
    return None if type(v) is int and v in (1, 2) else f"must be 1 or 2 (the ZeRO stage), got {type(v).__name__} {v!r}"


@dataclass
class EngineConfig:
    """Batch, schedule, optimizer and precision of a training run (see docs/parallelism.md)."""

    micro_batch_size: int = option(1, at_least(1), "sequences per micro-batch")
    global_batch_size: int = option(8, at_least(1), "sequences per optimizer step, over all dp ranks")
    schedule: str = option("1f1b", one_of(*SCHEDULES), "pipeline schedule (ignored when pp = 1)")
    virtual_stages: int | None = option(None, optional(at_least(1)),
                                        "model chunks per pp rank; None: 2 for interleaved schedules, else 1")
    stage_layers: tuple[int, ...] | None = option(None, _stage_layers,
                                                  "explicit layers per stage (chunk); None: even split")
    use_distributed_optimizer: bool = option(False, boolean, "optimizer state (and main weights) sharded over dp: "
                                             "ZeRO-1, or ZeRO-2 with zero_stage")
    zero_stage: int | None = option(None, optional(_zero_stage), "with use_distributed_optimizer (None: 2): 1 "
                                    "all-reduces the gradients, every dp rank keeps them all; 2 reduce-scatters them, "
                                    "each rank keeps its owned parameters' gradients (~1/dp)")
    optimizer: str = option("adam", one_of(*OPTIMIZERS), "adam: AdamW (decoupled weight decay); sgd: SGD with "
                            "momentum (weight decay added to the gradient)")
    lr: float = option(1e-3, positive_number, "learning rate (the schedule sets it each step)")
    weight_decay: float = option(0.01, _non_negative, "weight decay")
    adam_beta1: float = option(0.9, _unit, "AdamW's first-moment decay")
    adam_beta2: float = option(0.999, _unit, "AdamW's second-moment decay")
    adam_eps: float = option(1e-8, positive_number, "AdamW epsilon (added to sqrt of the second moment)")
    sgd_momentum: float = option(0.9, _non_negative, "SGD's momentum")
    clip_grad: float = option(1.0, _non_negative, "clip the global gradient norm to this; 0 = off")
    precision: str = option("fp32", one_of(*PRECISIONS), "fp32, or bf16/fp16 weights and gradients with float32 "
                            "main weights in the optimizer (fp16: + loss scaling); see docs/parallelism.md")
    loss_scale: float | None = option(None, optional(positive_number),
                                      "fp16: a static loss scale (never changes; an overflow still skips the step); "
                                      "None: dynamic, the four fields below")
    initial_loss_scale: float = option(2.0**16, positive_number, "fp16: the dynamic loss scale to start from")
    min_loss_scale: float = option(1.0, positive_number, "fp16: the dynamic scale never backs off below this")
    loss_scale_window: int = option(1000, at_least(1), "fp16: clean steps in a row before the scale doubles")
    hysteresis: int = option(1, at_least(1), "fp16: overflows since the last growth before the scale halves "
                             "(Megatron's --hysteresis, whose default is 2; 1: at every overflow)")
    local_sgd_steps: int | None = option(None, optional(at_least(1)), "local SGD (tpzoo.engine.local_sgd): each dp "
                                         "replica takes this many steps on its own gradients, then the replicas "
                                         "average their moves in an outer step; None: gradients summed every step")
    outer_lr: float = option(1.0, positive_number, "with local_sgd_steps: the outer step's learning rate (1: the "
                             "replicas' mean)")
    bucket_mb: float = option(25.0, positive_number, "gradient all-reduce bucket size over dp, MiB")
    timeout_s: float = option(600.0, positive_number, "timeout of the process groups the engine makes and bound "
                              "of its roll call (--distributed-timeout-minutes x 60)")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.loss_scale is not None and self.precision != "fp16":
            raise ValueError(f"EngineConfig.loss_scale={self.loss_scale} needs precision='fp16', got "
                             f"precision={self.precision!r}; drop the loss scale or train in fp16")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(f"EngineConfig.min_loss_scale={self.min_loss_scale} exceeds initial_loss_scale="
                             f"{self.initial_loss_scale}; lower the minimum or raise the initial scale")
        if self.zero_stage is not None and not self.use_distributed_optimizer:
            raise ValueError(f"EngineConfig.zero_stage={self.zero_stage} needs use_distributed_optimizer=True (the "
                             f"stage of its sharding); turn it on or drop zero_stage")
        if self.local_sgd_steps is not None and self.use_distributed_optimizer:
            raise ValueError(f"EngineConfig.local_sgd_steps={self.local_sgd_steps}: each dp replica keeps all its "
                             f"weights and optimizer state, which the distributed optimizer shards over dp; drop one")
        if self.use_distributed_optimizer and self.zero_stage is None:
            self.zero_stage = 2
        if self.virtual_stages is None:
            self.virtual_stages = 2 if self.schedule in INTERLEAVED else 1
        if self.virtual_stages > 1 and self.schedule not in INTERLEAVED:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs an interleaved schedule "
                             f"({', '.join(INTERLEAVED)}), got schedule={self.schedule!r}")

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)


def micro_batches(config: EngineConfig, dp: int, pp: int = 1, batch_size: int | None = None) -> int:
    """m = batch_size (default: global_batch_size) / (micro_batch_size x dp), or a ValueError naming the
    numbers: not divisible; at pp > 1 fewer than pp micro-batches for the 1f1b and interleaved schedules, or
    for the interleaved ones an m that torch's rounds of m // pp do not divide (m = 5 at pp 2).
    A step may take any batch size that passes (a batch size ramp-up)."""
    g = config.global_batch_size if batch_size is None else batch_size
    per_step = config.micro_batch_size * dp
    if g % per_step or g < 1:
        raise ValueError(f"global batch size {g} is not divisible by micro batch size x dp = "
                         f"{config.micro_batch_size} x {dp} = {per_step}; use a multiple of {per_step}")
    m = g // per_step
    if pp > 1 and config.schedule != "gpipe" and m < pp:
        raise ValueError(f"the {config.schedule} schedule needs at least pp={pp} micro-batches per step, got "
                         f"{m} (global batch {g} / (micro batch {config.micro_batch_size} x dp {dp})); raise the "
                         f"global batch size or lower the micro batch size")
    if pp > 1 and config.schedule in INTERLEAVED and m % (m // pp):
        raise ValueError(f"the {config.schedule} schedule runs the micro-batches in m // pp = {m // pp} rounds, which "
                         f"must divide m = {m} (global batch {g} / (micro batch {config.micro_batch_size} x dp {dp})); "
                         f"use a global batch giving a multiple of pp={pp} micro-batches")
    return m


def split_layers(num_layers: int, chunks: int, stage_layers: tuple[int, ...] | None = None) -> list[range]:
    """The layer numbers of each of ``chunks`` consecutive stages.

    Explicit ``stage_layers`` must sum to ``num_layers``. Otherwise an even split of the layers, or,
    when that does not divide, of the layers plus the embedding and the head weighing one layer each
    (the first and last stage then hold one layer fewer): 14 layers on 8 stages -> 1, 2, ..., 2, 1.
    """
    if stage_layers is not None:
        if len(stage_layers) != chunks or sum(stage_layers) != num_layers:
            raise ValueError(f"stage_layers={stage_layers} must give {chunks} stages (pp x virtual stages) "
                             f"summing to num_layers={num_layers}")
        counts = list(stage_layers)
    elif num_layers % chunks == 0:
        counts = [num_layers // chunks] * chunks
    elif (num_layers + 2) % chunks == 0 and chunks > 1:
        per = (num_layers + 2) // chunks
        counts = [per - 1] + [per] * (chunks - 2) + [per - 1]
    else:
        raise ValueError(f"num_layers={num_layers} cannot be split evenly into {chunks} pipeline stages "
                         f"(pp x virtual stages), not even with the embedding and head as a layer each "
                         f"({num_layers} + 2 = {num_layers + 2}); choose a layer count divisible by {chunks} "
                         f"or give stage_layers explicitly")
    starts = [sum(counts[:i]) for i in range(chunks)]
    return [range(start, start + n) for start, n in zip(starts, counts)]


def check_fits(config: EngineConfig, num_layers: int, pp: int, dp: int) -> tuple[int, list[range]]:
    """(micro-batches per step, layers of every stage), or a ValueError before any work is done."""
    m = micro_batches(config, dp, pp)
    chunks = pp * config.virtual_stages
    if pp == 1 and config.virtual_stages > 1:
        raise ValueError(f"virtual_stages={config.virtual_stages} needs pp > 1 (interleaving splits a pipeline)")
    return m, split_layers(num_layers, chunks, config.stage_layers)
