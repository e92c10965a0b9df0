"""The pretraining loop over a built ``Run``: lr, step, evaluate, log, save; then the summary.

Iteration i (1-based) takes the global batch size B = ``run.batches.batch_at(c)`` and sets the lr to
``schedule.lr_at`` of the samples before it (c consumed samples; Megatron-LM's schedules, ``tpzoo.training.
lr_schedule``, ``tpzoo.training.batch_schedule``), trains on the next B samples (logged as ``global_batch_size``),
evaluates when i is a multiple of ``--eval-interval`` (and at the end), logs, and saves when i is a
multiple of ``--save-interval``, once ``--save-interval-minutes`` have passed since the last save (rank 0's clock,
agreed by the stop check's all-reduce), and at the end. Evaluation e = i // eval_interval reads global
batches [e n, (e + 1) n) of the valid split (n = ``--eval-iters``), so a run resumed at i sees the
same validation data as the run that saved there. A resumed run evaluates once right after loading,
on the batches of the iteration it resumes at, and prints that val loss. ``--train-iters 0`` runs no
step: it evaluates the initial model and saves it as the checkpoint of iteration 0 (a control run).

Early stops (``tpzoo.training.stopping``): after a step, SIGTERM/SIGINT, ``--exit-interval`` or
``--exit-duration-in-mins`` save a checkpoint of that iteration and end the loop with one line (exit
status 0); ``--max-skipped-steps`` skipped steps in a row end it with ``Diverged`` (exit status 1).
No checkpoint is saved while the last step was skipped (``engine.bad_steps`` > 0): ``latest`` stays
on the last one of a finite step. Saves run with ``background=True``: the steps go on while each rank
hashes its files and rank 0 publishes the checkpoint (``--async-save``: while the tensors are written, too); the
loop waits for the last one before it ends.

Besides ``loss`` each line logs its parts under the names the model family gives them
(``StagedModel.loss_names``: BERT's ``mlm_loss`` and ``sop_loss``, GPT none), and the summary compares
the token-level part (the ``labels`` key's: GPT's loss, BERT's MLM loss) with the unigram entropy.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack, closing
from dataclasses import dataclass, field

import torch.distributed as dist

from tpzoo.checkpoint import save_checkpoint, wait_for_save
from tpzoo.data.demo import unigram_entropy
from tpzoo.data.indexed import IndexedDataset
from tpzoo.engine.evaluate import eval_losses
from tpzoo.engine.timers import Timers
from tpzoo.training.metrics import Metrics, flops_per_token, peak_flops
from tpzoo.training.monitor import monitor_options, step_stats
from tpzoo.training.run_summary import summary_lines
from tpzoo.training.config_file import CONFIG_FILE
from tpzoo.training.fault_tolerance import rejoin
from tpzoo.training.setup import Run
from tpzoo.training.stopping import Diverged, StopRules, check_divergence, skipped_save
from tpzoo.training.stragglers import Stragglers

MAX_ENTROPY_TOKENS = 1 << 31  # the summary's unigram entropy reads every token; skip it beyond this


@dataclass
class Summary:
    iteration: int
    loss: float | None          # the last iteration's train loss (None if nothing was trained)
    val_loss: float | None      # the last evaluation's
    checkpoint: str | None      # the last checkpoint saved
    stopped: str | None = None  # why the loop stopped before --train-iters (a signal, --exit-interval ...)
    losses: dict[str, float] = field(default_factory=dict)      # the named parts of loss (BERT: mlm_loss, sop_loss)
    val_losses: dict[str, float] = field(default_factory=dict)  # and of val_loss


def validation_loss(run: Run, iteration: int) -> tuple[float, dict[str, float]]:
    """Mean loss of the ``--eval-iters`` valid batches of evaluation ``iteration // eval_interval``,
    measured as the training loss is (BERT: masked-LM + sentence-order loss), and its mean part of
    each label key."""
    g, n = run.engine.config.global_batch_size, run.job.io.eval_iters
    first = iteration // run.job.io.eval_interval * n
    batches = [run.batch(run.valid, (first + j) * g) for j in range(n)]
    results = [eval_losses(run.engine, b) for b in batches]
    return sum(loss for loss, _ in results) / n, {k: sum(parts[k] for _, parts in results) / n for k in results[0][1]}


def loss_names(run: Run) -> dict[str, str]:
    """Label key -> metric name of the loss parts to log, from the model family (``StagedModel.loss_names``)."""
    return type(run.engine.chunks[0].model).loss_names(run.train)


def named(parts: dict[str, float], names: dict[str, str]) -> dict[str, float]:
    """The parts that have a metric name, by that name."""
    return {names[k]: v for k, v in parts.items() if k in names}


def save(run: Run, summary: Summary, metrics: Metrics) -> None:
    """Save the checkpoint of ``run.iteration`` into ``summary.checkpoint``; skipped (and said) while
    the last step was skipped for a non-finite loss or gradient norm."""
    if run.engine.bad_steps:
        metrics.print(skipped_save(run.iteration, run.engine.bad_steps, summary.checkpoint))
        return
    files = {CONFIG_FILE: run.config_file} if run.config_file else {}
    summary.checkpoint = str(save_checkpoint(run.save_dir, run.iteration, run.engine, meta=run.meta(),
                                             background=True, files=files, **run.job.checkpoint.save_options()))
    run.health.saved(summary.checkpoint)


def data_entropy(run: Run) -> float | None:
    """Unigram entropy of the training data (nats/token: the loss of a model that ignores context),
    or None for data too large to count quickly or blended from several prefixes."""
    if isinstance(run.job.data.data_path, list) or len(IndexedDataset(run.data_prefix).tokens) > MAX_ENTROPY_TOKENS:
        return None
    return unigram_entropy(run.data_prefix, run.tokenizer.vocab_size)


def evaluate(run: Run, summary: Summary, names: dict[str, str]) -> tuple[float, dict[str, float]]:
    """``validation_loss`` at ``run.iteration``, kept in ``summary``: (val loss, its named parts)."""
    summary.val_loss, parts = validation_loss(run, run.iteration)
    summary.val_losses = named(parts, names)
    return summary.val_loss, summary.val_losses


def _figure(name: str, value: float, parts: dict[str, float]) -> str:
    """``val loss 4.6800 (mlm_loss 3.9900, sop_loss 0.6900)``."""
    return f"{name} {value:.4f}" + (f" ({', '.join(f'{k} {v:.4f}' for k, v in parts.items())})" if parts else "")


def report(summary: Summary, entropy: float | None, names: dict[str, str]) -> str:
    """The end-of-run line: the final and val loss (with their parts) and the unigram entropy; where the
    loss has parts, the token-level one (``labels``: BERT's MLM loss; val if evaluated) against the entropy."""
    figures = [_figure(name, value, parts) for name, value, parts in (("final loss", summary.loss, summary.losses),
               ("val loss", summary.val_loss, summary.val_losses)) if value is not None]
    if entropy is not None:
        figures.append(f"unigram entropy of the training data {entropy:.4f}")
    text = f"done at iteration {summary.iteration}: " + ", ".join(figures) + " (nats/token)" * bool(figures)
    token = names.get("labels")  # the per-token part, comparable with the entropy
    for parts, which in ((summary.val_losses, "val "), (summary.losses, "")):
        if entropy is not None and token in parts:
            gap = parts[token] - entropy
            return text + f"; {which}{token} {parts[token]:.4f} is {abs(gap):.4f} {'below' if gap < 0 else 'above'} it"
    return text


def train(run: Run) -> Summary:
    """Train ``run`` from ``run.iteration`` to ``run.train_iters``; evaluate, log and save on the way."""
    engine, rank0, io, logging = run.engine, dist.get_rank() == 0, run.job.io, run.job.logging
    # the logging section's measurements (docs/training.md): timers by --timing-log-level, the weights' norm, zeros
    timers = engine.timers = Timers(logging.timing_log_level, run.mesh.device)
    engine.measure_params_norm, engine.measure_num_zeros = logging.log_params_norm, logging.log_num_zeros_in_grad
    own = Stragglers(logging.log_straggler, run.mesh.device)  # --log-straggler: each rank's own work per step
    logged_at = run.iteration
    summary = Summary(run.iteration, None, None, str(run.loaded_from) if run.loaded_from else None)
    names, evaluating = loss_names(run), io.eval_interval > 0
    with ExitStack() as opened:  # closed however the loop ends: the --num-workers workers, the writers
        if run.reader is not None:
            opened.callback(run.reader.close)
        if engine.replicas is not None:
            opened.callback(engine.replicas.close)
        stopping = run.job.stopping
        rules = opened.enter_context(StopRules.of(stopping, run.mesh.device, io.save_interval_minutes))
        metrics = opened.enter_context(closing(Metrics(
            run.log_dir, run.train_iters, io.log_interval, start=run.iteration,
            flops_per_token=flops_per_token(run.config, run.job.model.seq_length),
            peak_flops=peak_flops(run.mesh.device, engine.config.precision), world_size=dist.get_world_size(),
            enabled=rank0, **monitor_options(logging, run.job.flags, run.log_dir, run.save_dir.name, rank0))))
        for line in summary_lines(run):  # what is trained, where, in how much memory, on what data
            metrics.print(line)
        if run.loaded_from is not None:
            val = evaluate(run, summary, names)[0] if evaluating else None
            # --finetune: the weights only, from iteration 0
            how = "finetuning" if run.job.checkpoint.finetune else "resumed"
            metrics.print(f"{how} from {run.loaded_from} at iteration {run.iteration} (consumed samples "
                          f"{run.consumed_samples})" + (f": val loss {val:.6f}" if evaluating else ""))
            if run.mesh_change:
                metrics.print(run.mesh_change)
            if run.lr_schedule_changes:
                metrics.print(f"the flags change the checkpoint's lr schedule ({', '.join(run.lr_schedule_changes)}"
                              f"); the flags' schedule applies from iteration {run.iteration + 1} on")
            if run.run_changes:
                metrics.print(f"the flags change what the resumed run trains on: {', '.join(run.run_changes)}")
        if (note := run.schedule.warmup_outlasts_decay()) and run.iteration < run.train_iters:
            metrics.print(note)
        while run.iteration < run.train_iters and summary.stopped is None:
            if engine.replicas is not None and (note := rejoin(run)):  # the quorum; a group behind takes a peer's
                metrics.print(note)
            timers.start("iteration")
            run.iteration += 1
            g = run.batches.batch_at(run.consumed_samples)  # this iteration's global batch size
            lr = run.schedule.apply(engine.optimizer, run.lr_steps)
            own.start()
            timers.start("batch")
            with own.reading():
                batch = run.batch(run.train, run.consumed_samples, g)
            timers.stop("batch")
            start = time.perf_counter()
            result = engine.train_step(batch)
            own.stop()
            if not result.committed:  # torchft's commit said no: nothing changed, take the step again
                timers.stop("iteration")
                live, least = result.live_replicas, run.job.parallel.ft_min_replicas
                why = (f"only {live} replica groups live, --ft-min-replicas {least}" if live < least else
                       f"a replica group failed during the step ({live} were live)")
                metrics.print(f"iteration {run.iteration}: {why}; no update, the step is taken again")
                run.iteration -= 1
                continue
            run.consumed_samples += g
            run.lr_steps += 0 if result.skipped else g  # Megatron's scheduler steps on an update only
            metrics.step(g * run.job.model.seq_length, time.perf_counter() - start)
            last = run.iteration == run.train_iters
            val, val_losses = None, {}
            if evaluating and (run.iteration % io.eval_interval == 0 or last):
                timers.start("evaluate")
                val, val_losses = evaluate(run, summary, names)
                timers.stop("evaluate")
                if logging.log_validation_ppl_to_tensorboard:
                    val_losses = {**val_losses, "ppl": math.exp(min(val, 700.0))}
            summary.iteration, summary.loss, summary.losses = run.iteration, result.loss, named(result.losses, names)
            timers.stop("iteration")
            stats = step_stats(logging, result, run.mesh.device, dist.get_world_size())
            if metrics.line_due(run.iteration, evaluated=val is not None, last=last):  # every rank: a collective
                stats.update(timers.collect(run.iteration - logged_at, logging.timing_log_option), **own.collect())
                logged_at = run.iteration
            metrics.log(run.iteration, loss=result.loss, losses=summary.losses, lr=lr, grad_norm=result.grad_norm,
                        val_loss=val, val_losses=val_losses, last=last, skipped=result.skipped,
                        loss_scale=engine.loss_scale, stats={**stats, "global_batch_size": g})
            if note := run.health.step(run.iteration, result.loss, result.grad_norm):
                metrics.print(note)
            try:
                check_divergence(engine, stopping.max_skipped_steps, run.iteration, run.health)
            except Diverged:
                wait_for_save()  # the checkpoint the line names is published before the run ends
                raise
            summary.stopped = None if last else rules.reason(run.iteration)
            if last or summary.stopped or rules.save_due or (io.save_interval and
                                                              run.iteration % io.save_interval == 0):
                timers.start("save")
                save(run, summary, metrics)
                timers.stop("save")
                rules.saved()
        if run.iteration == run.train_iters == 0:  # no step (a control run): the initial model, evaluated and saved
            if evaluating and run.loaded_from is None:
                evaluate(run, summary, names)
            save(run, summary, metrics)
        wait_for_save()
        for line in own.summary():
            metrics.print(line)
        if summary.stopped is not None:
            metrics.print(f"stopped at iteration {run.iteration} of {run.train_iters}: {summary.stopped}; "
                          f"checkpoint: {summary.checkpoint} (resume with --load {run.save_dir})")
        elif rank0:
            metrics.print(report(summary, data_entropy(run), names)
                          + f"\ncheckpoint: {summary.checkpoint}\nmetrics: {run.log_dir / 'metrics.jsonl'}")
    return summary
