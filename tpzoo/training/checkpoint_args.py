"""The run's folders and intervals (``RunIO``: --save, --load, --log-dir, the intervals), Megatron-LM's checkpoint
flags (``CheckpointConfig``), and which checkpoint a run loads (docs/checkpoints.md).

    --finetune                     load the model weights only: iteration 0, consumed samples 0, a fresh
                                   optimizer and lr schedule, the RNG as seeded; saves go to --save (or a
                                   new runs/ folder), never into the loaded one; --load may be a model
                                   folder (a converted Hugging Face model: continued pretraining)
    --no-load-optim / --no-load-rng  resume without the optimizer state (and loss scale) / the RNG states
    --no-save-optim / --no-save-rng  save without them (meta.json says so; loading such a checkpoint then
                                   needs --no-load-optim / --no-load-rng or --finetune, else one line naming it)
    --use-checkpoint-args          accepted: --load always takes the checkpoint's flags (those not given)
    --exit-on-missing-checkpoint   the --save DIR --load DIR idiom below is an error instead

``--save DIR --load DIR`` with DIR holding no checkpoint yet (missing or without iteration folders)
starts from scratch with one printed line, as Megatron-LM does, so one launch line starts a run and
resumes it; ``--load`` naming a missing folder that is not ``--save`` stays an error (exit status 2).
The flags are the launch's: a resume never takes them from the checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpzoo.fields import at_least, check_fields, option, optional, positive_number, string, toggle


@dataclass(frozen=True)
class RunIO:
    """Where a run saves and from what it resumes, and how often it evaluates, logs and saves (``run``)."""

    save: str | None = option(None, optional(string), "checkpoint folder (default: runs/<model>-<time>)", "--save",
                              "DIR", launch=True)
    save_interval: int | None = option(None, optional(at_least(1)),
                                       "save every N iterations (default: only at the end)",
                                       ("--save-interval", "--persistent-save-interval"))
    save_interval_minutes: float | None = option(None, optional(positive_number), "also save once M minutes have "
                                                 "passed since the last save (rank 0's clock)",
                                                 "--save-interval-minutes", "M")
    load: str | None = option(None, optional(string), "resume the run saved in DIR (its newest checkpoint, or "
                              "DIR/iter_N) as it was configured; flags given change only what they name", "--load",
                              "DIR", launch=True)
    eval_interval: int = option(50, at_least(0), "validation loss every N iterations and at the end; 0 = never",
                                "--eval-interval")
    eval_iters: int = option(4, at_least(1), "global batches per evaluation", "--eval-iters")
    log_interval: int = option(10, at_least(1), "log every N iterations", "--log-interval")
    log_dir: str | None = option(None, optional(string), "metrics.jsonl and TensorBoard events (default: the --save "
                                 "dir)", "--log-dir", "DIR", path=True)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class CheckpointConfig:
    """Megatron-LM's checkpoint flags (docs/checkpoints.md): what a run loads and saves."""

    finetune: bool = toggle("load only the model weights of --load (a checkpoint or a model folder): iteration 0, "
                            "fresh optimizer, no RNG, consumed samples 0", "--finetune", launch=True)
    no_load_optim: bool = toggle("resume without the optimizer state", "--no-load-optim", launch=True)
    no_load_rng: bool = toggle("resume without the RNG states", "--no-load-rng", launch=True)
    no_save_optim: bool = toggle("save without the optimizer state", "--no-save-optim", launch=True)
    no_save_rng: bool = toggle("save without the RNG states", "--no-save-rng", launch=True)
    async_save: bool = toggle("write each checkpoint's tensors in the background (torch.distributed.checkpoint's "
                              "async_save): the steps go on once they are copied out; a save waits for the one in "
                              "flight, and a killed write leaves latest on the one before", "--async-save",
                              launch=True)
    use_checkpoint_args: bool = toggle("accepted: --load always takes the checkpoint's flags (those not "
                                       "given)", "--use-checkpoint-args", launch=True)
    exit_on_missing_checkpoint: bool = toggle("--load DIR that holds no checkpoint is an error even when it is "
                                              "the --save DIR", "--exit-on-missing-checkpoint", launch=True)

    def check(self, io: RunIO) -> None:
        """ValueError for --finetune or --use-checkpoint-args without --load (they say what to load from it), and for
        --load of a model folder without --finetune (it holds weights, no run to resume)."""
        for flag in ("finetune", "use_checkpoint_args"):
            if getattr(self, flag) and io.load is None:
                raise ValueError(f"--{flag.replace('_', '-')} reads the checkpoint of --load; add --load DIR")
        if io.load is not None and model_folder_record(io.load) is not None and not self.finetune:
            raise ValueError(f"--load {io.load} is a model folder (weights, no training run to resume); add --finetune "
                             f"to train from its weights at iteration 0")

    def load_options(self) -> dict[str, bool]:
        """``load_checkpoint``'s options."""
        return dict(load_optimizer=not (self.finetune or self.no_load_optim),
                    load_rng=not (self.finetune or self.no_load_rng))

    def save_options(self) -> dict[str, bool]:
        """``save_checkpoint``'s options."""
        return dict(save_optimizer=not self.no_save_optim, save_rng=not self.no_save_rng, async_write=self.async_save)


def model_folder_record(path: str | Path) -> dict[str, Any] | None:
    """What the tpzoo model folder ``path`` records (``tpzoo.models.pretrained``: config.json and the full weights, as
    ``python -m tpzoo.convert from-hf`` writes): its config.json's "class", "options" (constructor options) and "config"
    (``model_type``: the family), or None when ``path`` is not one. ValueError for a Hugging Face folder (to convert
    first)."""
    import json

    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        meta = json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError):
        return None  # not a model folder's config: resolve_checkpoint names what the folder lacks
    if not isinstance(meta, dict):
        return None
    if "model_type" in meta and meta.get("format") is None:
        raise ValueError(f"--load {path} is a Hugging Face folder (model_type {meta['model_type']!r}); convert it "
                         f"first: python -m tpzoo.convert from-hf {path} OUT_DIR, then --load OUT_DIR --finetune")
    # "tpzoo-model": tpzoo.models.pretrained.FORMAT, not imported: this module loads without torch
    if meta.get("format") != "tpzoo-model" or not isinstance(meta.get("config"), dict):
        return None
    return meta



def holds_no_checkpoint(path: Path) -> bool:
    """True when ``path`` is missing, or a folder with neither ``latest``, iteration folders nor a
    checkpoint's own files (what a first run's --save folder looks like)."""
    from tpzoo.checkpoint.paths import LATEST_FILE, META_FILE, NAME

    if not path.exists():
        return True
    return path.is_dir() and not any(p.name in (LATEST_FILE, META_FILE) or NAME.fullmatch(p.name)
                                     for p in path.iterdir())


def first_run(io: RunIO) -> bool:
    """Whether --load is the --save folder and holds no checkpoint yet (Megatron-LM's one launch line that starts
    a run and resumes it)."""
    return (io.save is not None and os.path.abspath(io.save) == os.path.abspath(io.load)
            and holds_no_checkpoint(Path(io.load)))


def checkpoint_to_load(io: RunIO, checkpoint: CheckpointConfig) -> Path | None:
    """The checkpoint folder of --load (collective: every rank checks its share), or None: no --load,
    or --load is the --save folder and holds no checkpoint yet (a first run; printed on rank 0) unless
    --exit-on-missing-checkpoint. FileNotFoundError / ValueError as ``resolve_checkpoint`` otherwise."""
    import torch.distributed as dist

    from tpzoo.checkpoint import resolve_checkpoint

    if io.load is None:
        return None
    if first_run(io):
        if checkpoint.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"--load {io.load} holds no checkpoint and --exit-on-missing-checkpoint is "
                                    f"given; drop that flag to start from scratch there")
        if dist.get_rank() == 0:
            print(f"no checkpoint in --load {io.load} (also the --save folder): starting from scratch", flush=True)
        return None
    return resolve_checkpoint(io.load, collective=True)
