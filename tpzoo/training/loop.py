"""The pretraining loop over a built ``Run``: lr, step, evaluate, log, save; then the summary.

Iteration i (1-based) sets the lr to ``schedule.lr_at(i)``, trains on the next global batch,
evaluates when i is a multiple of ``--eval-interval`` (and at the end), logs, and saves when i is a
multiple of ``--save-interval`` (and at the end). Evaluation e = i // eval_interval reads global
batches [e n, (e + 1) n) of the valid split (n = ``--eval-iters``), so a run resumed at i sees the
same validation data as the run that saved there. A resumed run evaluates once right after loading,
on the batches of the iteration it resumes at, and prints that val loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist

from tpzoo.checkpoint import save_checkpoint
from tpzoo.data.demo import unigram_entropy
from tpzoo.data.indexed import IndexedDataset
from tpzoo.engine.evaluate import eval_loss
from tpzoo.training.metrics import Metrics, flops_per_token, peak_flops
from tpzoo.training.setup import Run

MAX_ENTROPY_TOKENS = 1 << 31  # the summary's unigram entropy reads every token; skip it beyond this


@dataclass
class Summary:
    iteration: int
    loss: float | None          # the last iteration's train loss (None if nothing was trained)
    val_loss: float | None      # the last evaluation's
    checkpoint: str | None      # the last checkpoint saved


def validation_loss(run: Run, iteration: int) -> float:
    """Mean loss of the ``--eval-iters`` valid batches of evaluation ``iteration // eval_interval``,
    measured as the training loss is (BERT: masked-LM + sentence-order loss)."""
    g, n = run.engine.config.global_batch_size, run.args.eval_iters
    first = iteration // run.args.eval_interval * n
    batches = [run.batch(run.valid, (first + j) * g) for j in range(n)]
    losses = [eval_loss(run.engine, b) for b in batches]
    return sum(losses) / len(losses)


def save(run: Run) -> str:
    return str(save_checkpoint(run.save_dir, run.iteration, run.engine, meta=run.meta()))


def data_entropy(run: Run) -> float | None:
    """Unigram entropy of the training data (nats/token: the loss of a model that ignores context),
    or None for data too large to count quickly."""
    if len(IndexedDataset(run.data_prefix).tokens) > MAX_ENTROPY_TOKENS:
        return None
    return unigram_entropy(run.data_prefix, run.tokenizer.vocab_size)


def train(run: Run) -> Summary:
    """Train ``run`` from ``run.iteration`` to ``--train-iters``; evaluate, log and save on the way."""
    args, engine, rank0 = run.args, run.engine, dist.get_rank() == 0
    g, tokens = engine.config.global_batch_size, engine.config.global_batch_size * args.seq_length
    metrics = Metrics(run.log_dir, args.train_iters, args.log_interval, start=run.iteration,
                      flops_per_token=flops_per_token(run.config, args.seq_length),
                      peak_flops=peak_flops(run.mesh.device, engine.config.precision),
                      world_size=dist.get_world_size(), enabled=rank0)
    summary = Summary(run.iteration, None, None, str(run.loaded_from) if run.loaded_from else None)
    evaluating = args.eval_interval > 0
    if run.loaded_from is not None:
        val = validation_loss(run, run.iteration) if evaluating else None
        metrics.print(f"resumed from {run.loaded_from} at iteration {run.iteration} "
                      f"(consumed samples {run.consumed_samples})" + (f": val loss {val:.6f}" if evaluating else ""))
        summary.val_loss = val
        if run.lr_schedule_changes:
            metrics.print(f"the flags change the checkpoint's lr schedule ({', '.join(run.lr_schedule_changes)}); "
                          f"the flags' schedule applies from iteration {run.iteration + 1} on")
    while run.iteration < args.train_iters:
        run.iteration += 1
        lr = run.schedule.apply(engine.optimizer, run.iteration)
        start = time.perf_counter()
        result = engine.train_step(run.batch(run.train, run.consumed_samples))
        run.consumed_samples += g
        metrics.step(tokens, time.perf_counter() - start)
        last = run.iteration == args.train_iters
        val = None
        if evaluating and (run.iteration % args.eval_interval == 0 or last):
            val = summary.val_loss = validation_loss(run, run.iteration)
        metrics.log(run.iteration, loss=result.loss, lr=lr, grad_norm=result.grad_norm, val_loss=val, last=last)
        summary.iteration, summary.loss = run.iteration, result.loss
        if last or (args.save_interval and run.iteration % args.save_interval == 0):
            summary.checkpoint = save(run)
    if rank0:
        figures = (("final loss", summary.loss), ("val loss", summary.val_loss),
                   ("unigram entropy of the training data", data_entropy(run)))
        metrics.print(f"done at iteration {summary.iteration}: "
                      + ", ".join(f"{name} {value:.4f}" for name, value in figures if value is not None)
                      + f" (nats/token)\ncheckpoint: {summary.checkpoint}\nmetrics: {run.log_dir / 'metrics.jsonl'}")
    metrics.close()
    return summary
