"""The writers a run's numbers go to besides metrics.jsonl: TensorBoard and Weights & Biases (rank 0 only).

    writers = open_writers(logging, flags, log_dir, run_name)    # what the logging section asks for
    writer.add_scalar(tag, value, step); writer.close()

TensorBoard: ``--tensorboard-dir`` (needs the tensorboard package), else the log dir when tensorboard
is installed, and nothing when it is not. W&B: ``--wandb-project`` through the wandb library,
``wandb.init(project, name=--wandb-exp-name or the run folder's name, dir=--wandb-save-dir or
the log dir, entity=--wandb-entity, config=the run's flags)`` (wandb writes into DIR/wandb);
``WANDB_MODE=offline`` keeps the run in that folder without a network (``wandb sync`` uploads it later).
A flag whose library is missing is refused before any heavy work (``require``: one line naming
``pip install 'tpzoo[monitor]'``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # torch loads after the flags are checked (require runs before)
    import torch

    from tpzoo.training.logging_args import LoggingConfig

INSTALL = "pip install 'tpzoo[monitor]'"


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (tensorboard and wandb load slowly)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, what: str) -> None:
    """ValueError naming ``what`` (a flag or command) and the install line unless ``module`` is installed."""
    if not installed(module):
        raise ValueError(f"{what} needs the {module} package, which is not installed: {INSTALL}")


def tensorboard_writers(log_dir: str | Path, queue_size: int = 1000) -> list[Any]:
    """[a SummaryWriter into ``log_dir`` queueing ``queue_size`` events], or [] without tensorboard."""
    if not installed("tensorboard"):
        return []
    from torch.utils.tensorboard import SummaryWriter

    return [SummaryWriter(str(log_dir), max_queue=queue_size)]


def wandb_key_missing() -> bool:
    """Whether ``wandb.init`` would stop for want of an API key: the run is online (WANDB_MODE or
    ``wandb offline``'s settings file say neither offline nor disabled) and none of wandb's own sources
    holds one (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, the ~/.netrc entry ``wandb login`` writes, the
    settings files). Reads the environment and those files only: no network, no wandb service. A wandb
    without these internals (older than the one tested, 0.31) answers False: ``wandb.init`` decides."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import authenticate_session

        settings = wandb_setup.singleton().settings
        online = not (settings._offline or settings._noop)
    except (ImportError, AttributeError):
        return False
    return online and authenticate_session(host=settings.base_url, source="tpzoo", prompt=False,
                                           update_session=False) is None


class WandbWriter:
    """A W&B run with SummaryWriter's ``add_scalar``/``close``: each scalar logged under its tag at ``step``."""

    def __init__(self, project: str, name: str, save_dir: str | Path, entity: str | None,
                 config: dict[str, Any]) -> None:
        import wandb

        Path(save_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=str(save_dir), entity=entity, config=config)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def close(self) -> None:
        self.run.finish()


def check_logging(config: LoggingConfig) -> None:
    """ValueError naming the flag and the fix: a missing library (``monitor.require``), an online W&B run without
    an API key (``monitor.wandb_key_missing``)."""
    if config.tensorboard_dir is not None:
        require("tensorboard", "--tensorboard-dir")
    if config.wandb_project is not None:
        require("wandb", "--wandb-project")
        if wandb_key_missing():  # else rank 0 would stop in wandb.init while the others wait in a collective
            raise ValueError("--wandb-project needs a W&B API key and none is configured: run `wandb login` (or "
                             "set WANDB_API_KEY), or log without a network with WANDB_MODE=offline")


def open_writers(logging: LoggingConfig, flags: Mapping[str, Any], log_dir: Path, run_name: str) -> list[Any]:
    """The writers ``logging`` asks for (see the module's docstring; W&B's config: the run's ``flags``); rank 0
    calls this."""
    writers = tensorboard_writers(logging.tensorboard_dir or log_dir, logging.tensorboard_queue_size)
    if logging.wandb_project is not None:
        writers.append(WandbWriter(logging.wandb_project, logging.wandb_exp_name or run_name,
                                   logging.wandb_save_dir or log_dir, logging.wandb_entity,
                                   {k: str(v) if isinstance(v, Path) else v for k, v in flags.items()}))
    return writers


def shown(logging: LoggingConfig) -> Callable[[str], bool]:
    """Which metrics fields go to the writers: all but the loss scale under
    ``--no-log-loss-scale-to-tensorboard``, and the timers and throughput only with ``--log-timers-to-tensorboard``."""
    def show(key: str) -> bool:
        if key == "loss_scale":
            return logging.log_loss_scale_to_tensorboard
        if key.startswith("time/") or key == "throughput":
            return logging.log_timers_to_tensorboard
        return True
    return show


def monitor_options(logging: LoggingConfig, flags: Mapping[str, Any], log_dir: Path, run_name: str, rank0: bool
                    ) -> dict[str, Any]:
    """``Metrics``' keyword arguments from the logging section: the writers (rank 0's; none elsewhere), the
    throughput, the fields shown to the writers, the TensorBoard interval."""
    return dict(writers=open_writers(logging, flags, log_dir, run_name) if rank0 else [],
                throughput=logging.log_throughput, shown=shown(logging),
                board_interval=logging.tensorboard_log_interval)


def memory_stats(device: torch.device) -> dict[str, float]:
    """``--log-memory-to-tensorboard``: this process's memory in bytes: on CUDA the allocated, peak
    allocated and reserved bytes; on a CPU the peak resident set size."""
    import torch

    if device.type == "cuda":
        return {"mem_allocated_bytes": float(torch.cuda.memory_allocated(device)),
                "mem_max_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
                "mem_reserved_bytes": float(torch.cuda.memory_reserved(device))}
    import resource

    return {"mem_max_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}


def step_stats(logging: LoggingConfig, result: Any, device: torch.device, world_size: int) -> dict[str, float]:
    """The numbers the logging flags add to a train line from the step's ``result`` (a ``StepResult``):
    ``params_norm``, ``num_zeros``, memory, ``world_size``; and a mixture of experts' router losses and tokens per
    expert per layer (``tokens_per_expert``, [layer][expert]), always."""
    stats: dict[str, Any] = dict(getattr(result, "router_losses", {}))
    if getattr(result, "expert_tokens", None):
        stats["tokens_per_expert"] = result.expert_tokens
    if getattr(result, "live_replicas", None) is not None:
        stats["live_replicas"] = result.live_replicas
    if result.params_norm is not None:
        stats["params_norm"] = result.params_norm
    if result.num_zeros is not None:
        stats["num_zeros"] = result.num_zeros
    if logging.log_memory_to_tensorboard:
        stats.update(memory_stats(device))
    if logging.log_world_size_to_tensorboard:
        stats["world_size"] = world_size
    return stats
