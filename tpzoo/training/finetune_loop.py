"""The fine-tuning loop over a built ``FinetuneRun``: epochs of train steps, a validation after each,
logging, and the best checkpoint.

Before the first step rank 0 prints the run's ``report`` (classes, sample lengths against
``--seq-length``). Epoch e (1-based) visits every training sample once, in the order ``epoch_order(n, --seed, e)``,
in global batches of ``--global-batch-size`` (the last one padded with ignored samples, so every
mesh computes the same losses). Iteration i sets the lr to ``run.schedule.lr_at(i)``. After each
epoch the whole validation set is scored (``validate``) and logged with the epoch's last
iteration; with ``--save`` the best evaluation's checkpoint is kept (``BestCheckpoint``: accuracy for a
classifier, validation loss for a causal LM). With ``--elastic`` a run started again goes on from the newest
checkpoint of its ``--save`` folder (``tpzoo.training.finetune_resume``).
"""

from __future__ import annotations

import itertools
import math
import time
from contextlib import closing
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpzoo.data.batches import epoch_order, global_batches, num_batches
from tpzoo.engine.evaluate import eval_logits, eval_loss
from tpzoo.models.config import IGNORE_INDEX
from tpzoo.training.best_checkpoint import BEST, BestCheckpoint
from tpzoo.training.classification import classification_metrics
from tpzoo.training.finetune_resume import resume
from tpzoo.training.finetune_setup import FinetuneRun
from tpzoo.training.metrics import Metrics
from tpzoo.training.monitor import tensorboard_writers
from tpzoo.training.run_summary import setup_lines
from tpzoo.training.health import Health
from tpzoo.training.stopping import StopRules, check_divergence, skipped_save

# the metric that picks the best checkpoint, and whether higher is better
BEST_BY = {"classification": ("accuracy", True), "causal-lm": ("val_loss", False), "sft": ("val_loss", False)}


@dataclass
class FinetuneSummary:
    epochs: list[dict[str, float]] = field(default_factory=list)   # each epoch's validation scores
    best: float | None = None                                        # the best value of BEST_BY's metric
    best_checkpoint: str | None = None                               # save_dir/best, with --save
    stopped: str | None = None                                       # why it stopped early (a signal ...)


def validate(run: FinetuneRun) -> dict[str, float]:
    """Scores of the whole validation set, the same on every rank: ``val_loss`` and ``accuracy`` (+ ``f1``
    for two classes) of a classifier, ``val_loss`` (mean token loss) and ``perplexity`` of a causal LM.
    The classifier's logits [N, K] come on the mesh's device; its labels [N] are moved there."""
    g = run.engine.config.global_batch_size
    batches = list(global_batches(run.valid, g))
    if run.kind == "classification":
        logits = torch.cat([eval_logits(run.engine, b) for b in batches])
        return classification_metrics(logits, torch.cat([b["labels"] for b in batches]).to(logits.device))
    counts = [(b["labels"] != IGNORE_INDEX).sum().item() for b in batches]
    loss = sum(eval_loss(run.engine, b) * n for b, n in zip(batches, counts)) / sum(counts)
    return {"val_loss": loss, "perplexity": math.exp(loss)}


def finetune(run: FinetuneRun) -> FinetuneSummary:
    """Train ``--epochs`` epochs on ``run.train``, validating after each; returns the scores. A signal,
    ``--exit-interval`` or ``--exit-duration-in-mins`` (``tpzoo.training.stopping``) end the epoch early:
    it is validated and saved as the last one; ``--max-skipped-steps`` skipped steps in a row raise
    ``Diverged``. No checkpoint is saved while the last step was skipped (``engine.bad_steps`` > 0)."""
    tune, engine, rank0 = run.tune, run.engine, dist.get_rank() == 0
    g, n = engine.config.global_batch_size, len(run.train)
    schedule, steps = run.schedule, num_batches(n, g)
    metric, higher = BEST_BY[run.kind]
    keeper = BestCheckpoint(run.save_dir, metric, higher, run.adapters_of) if run.save_dir is not None else None
    resumed = resume(run, keeper)  # --elastic: the newest checkpoint of --save, if any
    summary, latest, health, cut = FinetuneSummary(), None, Health(), False
    iteration, first, skip = (resumed.iteration, resumed.epoch, resumed.skip) if resumed else (0, 1, 0)
    summary.epochs = list(resumed.history) if resumed else []
    with StopRules.of(run.job.stopping, run.mesh.device) as rules, closing(Metrics(
            run.log_dir, schedule.decay_steps, tune.log_interval, enabled=rank0, start=iteration,
            writers=tensorboard_writers(run.log_dir) if rank0 else [])) as metrics:
        for line in setup_lines(run.config, engine):  # the model, the mesh, the memory per rank
            metrics.print(line)
        metrics.print(f"fine-tuning {run.config.model_type} ({run.kind}) from {tune.load}: {n} training samples, "
                      f"{len(run.valid)} validation samples, {steps} steps per epoch")
        for line in run.report:
            metrics.print(line)
        for line in [resumed.line(), resumed.mesh_change] if resumed else []:
            if line:
                metrics.print(line)
        for epoch in range(first, tune.epochs + 1):
            batches = global_batches(run.train, g, epoch_order(n, run.job.training.seed, epoch))
            for batch in itertools.islice(batches, skip if epoch == first else 0, None):
                iteration += 1
                lr = schedule.apply(engine.optimizer, iteration)
                start = time.perf_counter()
                result = engine.train_step(batch)
                metrics.step(batch["input_ids"].numel(), time.perf_counter() - start)
                step = dict(loss=result.loss, lr=lr, grad_norm=result.grad_norm, skipped=result.skipped,
                            loss_scale=engine.loss_scale)
                summary.stopped = None if iteration == tune.epochs * steps else rules.reason(iteration)
                if iteration % steps and not summary.stopped:  # the epoch's last step: on the validation line
                    metrics.log(iteration, **step)
                if note := health.step(iteration, result.loss, result.grad_norm):
                    metrics.print(note)
                check_divergence(engine, run.job.stopping.max_skipped_steps, iteration, health,
                                 start=f"fine-tune {tune.load} again")
                if summary.stopped:
                    break
            scores = validate(run)
            summary.epochs.append(scores)
            extra = {k: v for k, v in scores.items() if k != "val_loss"}
            metrics.log(iteration, **step, val_loss=scores["val_loss"], epoch=epoch, **extra)
            last = epoch == tune.epochs or summary.stopped is not None
            # --elastic: a stop within an epoch is resumed, its validation redone at the epoch's end: no best
            cut = run.job.parallel.elastic and summary.stopped is not None and iteration % steps != 0
            if keeper is not None and engine.bad_steps:
                metrics.print(skipped_save(iteration, engine.bad_steps, latest))
            elif keeper is not None:
                meta = run.meta(epoch=epoch, scores=scores, history=summary.epochs)
                saved = keeper.update(iteration, engine, meta, scores[metric], last=last, candidate=not cut)
                if saved is not None:
                    latest = str(saved)
                    health.saved(latest)
            if last:
                break
        scored = [s[metric] for s in summary.epochs[:len(summary.epochs) - cut]]  # whole epochs' validations
        summary.best = (max if higher else min)(scored) if scored else None
        summary.best_checkpoint = str(run.save_dir / BEST) if keeper is not None and keeper.best_folder else None
        stop = f"stopped at iteration {iteration} (epoch {epoch}): {summary.stopped}; " if summary.stopped else ""
        best = (f"best {metric} {summary.best:.4f} (epoch {scored.index(summary.best) + 1})" if scored else
                "no whole epoch validated yet")
        metrics.print(f"{stop}{best}"
                      + (f"; checkpoint {summary.best_checkpoint}" if summary.best_checkpoint else "")
                      + (f"; last checkpoint {latest}" if stop and latest else "")
                      + f"; metrics {run.log_dir / 'metrics.jsonl'}")
    return summary
