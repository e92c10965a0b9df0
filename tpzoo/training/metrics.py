"""What a training run reports: ``metrics.jsonl``, a tqdm bar or plain lines, TensorBoard events, MFU.

    metrics = Metrics(log_dir, train_iters, log_interval, writers=monitor.open_writers(...), start=iteration,
                      flops_per_token=..., peak_flops=...)
    metrics.step(tokens, seconds)                       # after every train step
    metrics.log(iteration, loss=..., lr=..., grad_norm=..., val_loss=None, last=False,
                losses={"mlm_loss": ..., "sop_loss": ...}, val_losses=None,
                skipped=result.skipped, loss_scale=engine.loss_scale)
    metrics.close()

Each line of ``metrics.jsonl`` is one logged iteration: ``iteration``, ``loss`` (the global-batch
mean of that iteration) and its named parts (``losses``: BERT's ``mlm_loss`` and ``sop_loss``),
``lr``, ``grad_norm``, ``skipped`` (true: that iteration's step made no update, its loss or
gradient norm not finite or an fp16 overflow), ``loss_scale`` (fp16's; 1 otherwise), ``tokens_per_sec``
(over the train steps since the previous line), ``val_loss`` and its parts (``val_mlm_loss`` ...) on
eval lines and ``mfu`` where the device's peak is known; ``throughput`` (``throughput=True``: model
TFLOP/s per GPU, ``flops_per_token`` x tokens/s / world size / 1e12) and the caller's ``stats``
(``params_norm``, ``num_zeros``, ``time/<name>`` ...). The file is strict JSON: a non-finite number
(a diverged loss) is written as null. The printed line says ``SKIPPED`` on a skipped step, and the loss
scale when it is not 1.

``writers`` (from ``tpzoo.training.monitor``: TensorBoard, W&B; closed by ``close``) get each line's
numbers as scalars, tags ``train/<name>``, ``valid/<name>`` for the val_ fields and eval extras, a name
holding ``/`` (``time/optimizer``) as it is, a table of numbers (``tokens_per_expert``: [layer][expert]) one scalar
per cell (``tokens_per_expert/layer0/expert1``); ``shown(key)`` False keeps a field out of them
(``--no-log-loss-scale-to-tensorboard`` ...).
``board_interval``: the writers also get the train numbers of every iteration divisible by it (with
the tokens/s of the current window), between the lines.
Only the rank that makes the ``Metrics`` with ``enabled=True`` (rank 0) writes or prints anything.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from tpzoo.models.config import ModelConfig
from tpzoo.models.presets import num_parameters

# dense peak FLOP/s per GPU (no sparsity) by device-name fragment, first match wins: bf16, fp16, fp32
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", dict(bf16=989e12, fp16=989e12, fp32=67e12)),
    ("H100 PCIe", dict(bf16=756e12, fp16=756e12, fp32=51e12)),
    ("H100", dict(bf16=989e12, fp16=989e12, fp32=67e12)),
    ("A100", dict(bf16=312e12, fp16=312e12, fp32=19.5e12)),
    ("L40S", dict(bf16=362e12, fp16=362e12, fp32=91.6e12)),
    ("L4", dict(bf16=121e12, fp16=121e12, fp32=30.3e12)),
    ("V100", dict(fp16=125e12, fp32=15.7e12)),
    ("T4", dict(fp16=65e12, fp32=8.1e12)),
]


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of one ``device`` at ``precision`` (fp32/bf16/fp16), or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks.get(precision) for fragment, peaks in PEAK_FLOPS if fragment in name), None)


def active_parameters(config: ModelConfig) -> int:
    """The parameters one token goes through: all of them, less in a mixture of experts the N - k experts each layer's
    router leaves out (SwiGLU experts: 3 f h each). Mixtral-8x7B: 12,879,925,248 of 46,702,792,704."""
    experts = getattr(config, "num_experts", None)
    idle = experts and config.num_layers * (experts - config.moe_router_topk) * 3 * config.expert_ffn_size * \
        config.hidden_size
    return num_parameters(config) - (idle or 0)


def flops_per_token(config: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x the parameters a token goes through (``active_parameters``)
    + 12 x layers x hidden x seq for the attention scores (PaLM's count; the full, not the causal, score matrix)."""
    return 6.0 * active_parameters(config) + 12.0 * config.num_layers * config.hidden_size * seq_length


def format_line(record: dict[str, Any], train_iters: int) -> str:
    """One plain log line: ``iteration 10/100 | loss 4.2107 | lr 1.00e-03 | ...``."""
    parts = [f"iteration {record['iteration']}/{train_iters}"]
    formats = {"loss": ".4f", "val_loss": ".4f", "lr": ".2e", "grad_norm": ".3f", "loss_scale": "g",
               "tokens_per_sec": ",.0f", "mfu": ".1%", "throughput": ".3g", "params_norm": ".3f"}
    for key, fmt in formats.items():
        if record.get(key) is not None and not (key == "loss_scale" and record[key] == 1.0):
            parts.append(f"{key.replace('_', ' ')} {record[key]:{fmt}}")
    if record.get("skipped"):
        parts.append("SKIPPED (no update)")
    parts += [f"{key.replace('_', ' ')} {value:.4f}" if isinstance(value, float) else f"{key} {value}"
              for key, value in record.items()  # callers' extras, but tables (in metrics.jsonl and TensorBoard)
              if key not in formats and key not in ("iteration", "skipped") and not isinstance(value, list)]
    return " | ".join(parts)


def json_line(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON: non-finite floats become null (``json`` would write NaN)."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(finite, allow_nan=False)


def metrics_records(path: Path) -> list[tuple[int, str]]:
    """(iteration, line) of each line of the metrics.jsonl ``path`` (none when it does not exist); a last line cut
    short (a killed run) is left out. ValueError naming the file, the line and the fix for any other line that is
    not a record (a JSON object with an int ``iteration``): a resumed run rewrites the file from it."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as e:
            why = f"not JSON ({e.msg})"
        else:
            iteration = record.get("iteration") if isinstance(record, dict) else None
            if isinstance(iteration, int) and not isinstance(iteration, bool) and iteration >= 0:
                records.append((iteration, line))
                continue
            why = "no int iteration" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        if number < len(lines):
            raise ValueError(f"{path} line {number} is not a metrics record ({why}); a resumed run rewrites the file "
                             f"from it: delete that line, or move the file away to start a new one")
    return records


def open_metrics(path: Path, start: int) -> Any:
    """``path`` opened for appending, keeping only its lines up to iteration ``start`` (a resumed run
    replaces what the run it resumes logged after its checkpoint; ``metrics_records``)."""
    kept = [line for iteration, line in metrics_records(path) if iteration <= start]
    path.write_text("".join(line + "\n" for line in kept))
    return open(path, "a", encoding="utf-8")


class Metrics:
    """The run's log: metrics.jsonl (appended to on resume), the bar or plain lines, the writers."""

    def __init__(self, log_dir: str | Path, train_iters: int, log_interval: int, *, writers: list[Any],
                 start: int = 0, flops_per_token: float = 0.0, peak_flops: float | None = None, world_size: int = 1,
                 enabled: bool = True, interactive: bool | None = None,
                 throughput: bool = False, shown: Callable[[str], bool] = lambda key: True,
                 board_interval: int | None = None) -> None:
        self.train_iters, self.log_interval, self.enabled = train_iters, log_interval, enabled
        self.flops_per_token, self.peak = flops_per_token, (peak_flops * world_size if peak_flops else None)
        self.world_size, self.throughput = world_size, throughput
        self.shown, self.board_interval = shown, board_interval
        self.tokens, self.seconds = 0, 0.0
        self.file = self.bar = None
        self.writers = writers
        if not enabled:
            return
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.file = open_metrics(self.log_dir / "metrics.jsonl", start)
        if sys.stderr.isatty() if interactive is None else interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=train_iters, initial=start, unit="it", dynamic_ncols=True)

    def print(self, text: str) -> None:
        """A line on stdout (above the bar when there is one); rank 0 only."""
        if self.enabled and self.bar is not None:
            self.bar.write(text)
        elif self.enabled:
            print(text, flush=True)

    def step(self, tokens: int, seconds: float) -> None:
        """Count one train step of ``tokens`` tokens that took ``seconds``."""
        self.tokens += tokens
        self.seconds += seconds
        if self.bar is not None:
            self.bar.update(1)

    def line_due(self, iteration: int, *, evaluated: bool = False, last: bool = False) -> bool:
        """Whether ``log`` writes a metrics.jsonl line at ``iteration`` (every rank can ask: the timers'
        collective runs at these iterations)."""
        return iteration % self.log_interval == 0 or evaluated or last

    def log(self, iteration: int, *, loss: float, lr: float, grad_norm: float, val_loss: float | None = None,
            last: bool = False, losses: dict[str, float] | None = None, val_losses: dict[str, float] | None = None,
            skipped: bool = False, loss_scale: float = 1.0, stats: dict[str, float] | None = None,
            **extra: float) -> dict[str, Any] | None:
        """Write the line of ``iteration`` if it is due (log interval, eval, or ``last``); returns it.
        ``losses``: the parts of ``loss`` by name (``mlm_loss`` ...), ``val_losses`` those of ``val_loss``
        (logged as ``val_<name>``); ``skipped``, ``loss_scale``: the step's (``StepResult.skipped``,
        ``Engine.loss_scale``); ``stats``: more train numbers (``params_norm``, ``time/<name>`` ...);
        ``extra``: more numbers of an eval line (finetune.py: epoch, accuracy, f1, perplexity).
        Between lines, an iteration divisible by ``board_interval`` goes to the writers only."""
        line = self.line_due(iteration, evaluated=val_loss is not None, last=last)
        if not (line or (self.board_interval and iteration % self.board_interval == 0)):
            return None
        speed = self.tokens / self.seconds if self.seconds > 0 else 0.0
        record: dict[str, Any] = dict(iteration=iteration, loss=loss, **(losses or {}), lr=lr, grad_norm=grad_norm,
                                      skipped=bool(skipped), loss_scale=float(loss_scale), tokens_per_sec=speed)
        if self.throughput:
            record["throughput"] = speed * self.flops_per_token / self.world_size / 1e12
        record.update(stats or {})
        valid: dict[str, float] = {}
        if val_loss is not None:
            valid = {"val_loss": val_loss, **{f"val_{k}": v for k, v in (val_losses or {}).items()}}
        record.update(valid)
        record.update(extra)
        if self.peak:
            record["mfu"] = speed * self.flops_per_token / self.peak
        if line:
            self.tokens, self.seconds = 0, 0.0
        if not self.enabled:
            return record
        self._write_scalars(record, valid, extra)
        if not line:
            return record
        self.file.write(json_line(record) + "\n")
        self.file.flush()
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{speed:,.0f}", refresh=False)
            if val_loss is not None:
                self.bar.write(format_line(record, self.train_iters))
        else:
            print(format_line(record, self.train_iters), flush=True)
        return record

    def _write_scalars(self, record: dict[str, Any], valid: dict[str, float], extra: dict[str, float]) -> None:
        """The numbers of ``record`` that ``shown`` lets through, to every writer, tagged as the module says."""
        step = record["iteration"]
        for key, value in record.items():
            if key == "iteration" or value is None or not self.shown(key):
                continue
            tag = (key if "/" in key else f"valid/{key[4:]}" if key in valid else f"valid/{key}" if key in extra
                   else f"train/{key}")
            cells = ([(f"{key}/layer{i}/expert{j}", v) for i, row in enumerate(value) for j, v in enumerate(row)]
                     if isinstance(value, list) else [(tag, value)])
            for writer in self.writers:
                for name, number in cells:
                    writer.add_scalar(name, float(number), step)

    def close(self) -> None:
        for handle in (self.bar, *self.writers, self.file):
            if handle is not None:
                handle.close()
