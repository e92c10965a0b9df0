"""Megatron-LM's logging flags (its ``LoggerConfig``) as the run configuration's ``logging`` section: TensorBoard,
Weights & Biases, throughput, the params norm, zeros in the gradients and the timers. ``--log-interval`` and
``--log-dir`` stay with the run flags (``tpzoo.training.args.add_run_args``); what each field adds to a metrics
line: ``tpzoo.training.metrics`` (fields) and ``tpzoo.training.monitor`` (writers).

Checked before torch loads: a ``--wandb-*`` flag without ``--wandb-project`` (the section refuses it), a flag whose
library is not installed and ``--wandb-project`` online without a W&B API key (``monitor.check_logging``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpzoo.fields import at_least, boolean, check_fields, one_of, option, optional, string, toggle
TIMING_LEVELS = (0, 1, 2)
TIMING_OPTIONS = ("max", "minmax", "all")
WANDB_FLAGS = ("wandb_exp_name", "wandb_save_dir", "wandb_entity")
TO_BOARD = "to TensorBoard / W&B"


@dataclass(frozen=True)
class LoggingConfig:
    """What a run logs besides its loss lines (Megatron-LM's names; docs/training.md)."""

    tensorboard_dir: str | None = option(None, optional(string), "TensorBoard events here (needs tensorboard; "
                                         "default: the log dir when tensorboard is installed)", "--tensorboard-dir",
                                         "DIR", path=True)
    tensorboard_log_interval: int | None = option(None, optional(at_least(1)), f"also write the train scalars "
                                                  f"{TO_BOARD} every N iterations (default: the logged lines only)",
                                                  "--tensorboard-log-interval", "N")
    tensorboard_queue_size: int = option(1000, at_least(1), "events TensorBoard queues before it writes them to disk",
                                         "--tensorboard-queue-size", "N", launch=True)
    log_timers_to_tensorboard: bool = toggle(f"write the timers (time/<name>) and the throughput {TO_BOARD} too",
                                             "--log-timers-to-tensorboard")
    log_loss_scale_to_tensorboard: bool = option(True, boolean, "leave the loss scale out of TensorBoard / W&B", (
        "--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard"))
    log_validation_ppl_to_tensorboard: bool = toggle("log the validation perplexity exp(val loss) as val_ppl",
                                                     "--log-validation-ppl-to-tensorboard")
    log_memory_to_tensorboard: bool = toggle("log rank 0's memory: CUDA allocated / peak / reserved bytes, a CPU "
                                             "process's peak RSS", "--log-memory-to-tensorboard")
    log_world_size_to_tensorboard: bool = toggle("log the world size", "--log-world-size-to-tensorboard")
    log_batch_size_to_tensorboard: bool = toggle("older Megatron-LM's flag; tpzoo always logs the global batch size "
                                                 "(global_batch_size)", "--log-batch-size-to-tensorboard")
    log_throughput: bool = toggle("log the throughput: model TFLOP/s per GPU (6 x params + attention, per token)",
                                  "--log-throughput")
    log_params_norm: bool = toggle("log the L2 norm of all weights after each logged step (each weight counted once)",
                                   "--log-params-norm")
    log_num_zeros_in_grad: bool = toggle("log the number of zero entries of the reduced gradients (each counted "
                                         "once)", "--log-num-zeros-in-grad")
    log_straggler: bool = toggle("name the slowest rank and its lag each log line (own work per step: CPU time and "
                                 "batch reads; tpzoo.training.stragglers), the ranks that lagged at the end",
                                 "--log-straggler", launch=True)
    timing_log_level: int | None = option(None, optional(one_of(*TIMING_LEVELS)), "time the iteration (0), its "
                                          "forward-backward, gradient sync, optimizer, evaluation and save (1), and "
                                          "the batch read (2); logged as time/<name> seconds per iteration (default: "
                                          "no timers)", "--timing-log-level", "{0,1,2}", launch=True)
    timing_log_option: str = option("minmax", one_of(*TIMING_OPTIONS), "the timers over the ranks: max, minmax "
                                    "(time/<name> the max, time/<name>/min) or all (time/<name>/rank<r> too)",
                                    "--timing-log-option", launch=True)
    wandb_project: str | None = option(None, optional(string), "log to Weights & Biases under this project (needs "
                                       "wandb; WANDB_MODE=offline works without a network)", "--wandb-project", "NAME")
    wandb_exp_name: str | None = option(None, optional(string), "the W&B run's name (default: the run folder's name)",
                                        "--wandb-exp-name", "NAME")
    wandb_save_dir: str | None = option(None, optional(string), "W&B's local files go to DIR/wandb (default: the log "
                                        "dir)", "--wandb-save-dir", "DIR", path=True)
    wandb_entity: str | None = option(None, optional(string), "the W&B team or user the project belongs to",
                                      "--wandb-entity", "NAME")

    def __post_init__(self) -> None:
        check_fields(self)
        for name in WANDB_FLAGS:
            if getattr(self, name) is not None and self.wandb_project is None:
                raise ValueError(f"--{name.replace('_', '-')} names a W&B setting but W&B is off; add --wandb-project "
                                 f"NAME or drop --{name.replace('_', '-')}")
