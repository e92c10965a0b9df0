"""Pipeline bubble and in-flight micro-batches of each schedule, measured against the theory.

    python bench/pipeline.py                      # p=4 stages, m=8 micro-batches, v=2 for interleaving
    python bench/pipeline.py --stages 2 --microbatches 4 --fwd-ms 10
    python bench/pipeline.py --timeline pipeline.png   # also draw each rank's forwards, backwards and idle time

Each of the p ranks runs torch.distributed.pipelining's schedule over stages whose forward and
backward only sleep (fwd-ms and 2 x fwd-ms per micro-batch, split over the v chunks a rank holds),
so the figures measure the schedule, not the machine. Per stage:

    bubble = 1 - busy / wall      theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) interleaved
    peak in-flight = max over time of (forwards done - backwards done)   GPipe: m, 1F1B: <= p
    (counted in chunk forwards when a rank holds v > 1 chunks)

``--timeline PNG`` draws the measured step of every schedule as a timeline (needs matplotlib): one row
per rank, time across, forwards and backwards coloured, idle time (the bubble) left grey.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tpzoo.plot import check_output  # noqa: E402
from tpzoo.testing import spawn  # noqa: E402
from tpzoo.training.monitor import require  # noqa: E402

SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1), "interleaved-1f1b": (ScheduleInterleaved1F1B, 2)}


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each sleep and log (kind, start, end)."""

    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float, log: list):
        start = time.perf_counter()
        time.sleep(fwd_s)
        log.append(("F", start, time.perf_counter()))
        ctx.bwd_s, ctx.log = bwd_s, log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        time.sleep(ctx.bwd_s)
        ctx.log.append(("B", start, time.perf_counter()))
        return grad, None, None, None


class SleepStage(nn.Module):
    def __init__(self, fwd_s: float, bwd_s: float, log: list) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.fwd_s, self.bwd_s, self.log = fwd_s, bwd_s, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.w, self.fwd_s, self.bwd_s, self.log)


def theory(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


def inflight_bound(schedule: str, p: int, m: int, rank: int) -> int:
    """Most forwards (chunk forwards when interleaved) a stage holds before their backward."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - rank)
    v = SCHEDULES[schedule][1]  # warm-up of the interleaved schedule, then one more in steady state
    return min(v * m, (v - 1) * p + 2 * (p - 1 - rank) + 1)


def measure(schedule: str, m: int, fwd_ms: float) -> tuple[float, int, list]:
    """(bubble, peak in-flight micro-batches, the step's (kind, start s, end s) from its start) of this
    rank's stage for one schedule step."""
    rank, p = dist.get_rank(), dist.get_world_size()
    cls, v = SCHEDULES[schedule]
    log: list = []
    fwd_s = fwd_ms / 1000 / v
    chunks = [SleepStage(fwd_s, 2 * fwd_s, log) for _ in range(v)]
    stages = [PipelineStage(chunk, rank + k * p, v * p, torch.device("cpu")) for k, chunk in enumerate(chunks)]
    sched = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=lambda out, target: out.mean())
    x = torch.ones(m, 4)
    for attempt in range(2):  # the first step, without sleeps, warms up the p2p connections; time the second
        for chunk in chunks:
            chunk.fwd_s, chunk.bwd_s = (fwd_s, 2 * fwd_s) if attempt else (0.0, 0.0)
        log.clear()
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            sched.step(target=x)
        else:
            sched.step()
        dist.barrier()  # one window for every stage: the step ends when the last stage is done
        wall = time.perf_counter() - start
    busy = sum(end - begin for _, begin, end in log)
    inflight = peak = 0
    for kind, _, _ in sorted(log, key=lambda e: e[1]):
        inflight += 1 if kind == "F" else -1
        peak = max(peak, inflight)
    return 1.0 - busy / wall, peak, [(kind, begin - start, end - start) for kind, begin, end in log]


def draw_timeline(results: list[dict], path: str) -> None:
    """Each schedule's step (``results``: per rank, schedule -> ``measure``'s) as a PNG at ``path``: a row
    per rank, forwards and backwards as coloured bars over a grey row (idle)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p, colours = len(results), {"F": "tab:blue", "B": "tab:orange", "idle": "#dddddd"}
    fig, axes = plt.subplots(len(SCHEDULES), 1, figsize=(10, 1.2 + 0.45 * p * len(SCHEDULES)), dpi=100)
    for ax, name in zip(axes, SCHEDULES):
        wall = max(end for r in results for _, _, end in r[name][2]) * 1000
        for rank, r in enumerate(results):
            y = (p - 1 - rank, 0.8)  # rank 0 on top
            ax.broken_barh([(0, wall)], y, color=colours["idle"])
            for kind in "FB":
                bars = [(b * 1000, (e - b) * 1000) for k, b, e in r[name][2] if k == kind]
                ax.broken_barh(bars, y, color=colours[kind], edgecolor="white", linewidth=0.5)
        bubble = sum(r[name][0] for r in results) / p
        ax.set_title(f"{name}: bubble {bubble:.3f}", fontsize=10)
        ax.set_yticks([p - 1 - r + 0.4 for r in range(p)], [f"rank {r}" for r in range(p)])
        ax.set_xlim(0, wall)
    axes[-1].set_xlabel("ms since the step started")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.legend([Patch(color=colours[k]) for k in colours], ["forward", "backward", "idle"], loc="upper center",
               ncol=3, fontsize=8, frameon=False)
    fig.savefig(path)
    plt.close(fig)


def run_all(m: int, fwd_ms: float) -> dict:
    dist.init_process_group("gloo")
    return {name: measure(name, m, fwd_ms) for name in SCHEDULES}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pipeline bubble and in-flight micro-batches per schedule")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages p (one rank each)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches m per step")
    parser.add_argument("--fwd-ms", type=float, default=50.0, help="forward sleep per micro-batch and stage")
    parser.add_argument("--timeline", metavar="PNG", help="also draw each schedule's step as a timeline PNG")
    args = parser.parse_args(argv)
    p, m = args.stages, args.microbatches
    if p < 2 or m < p:
        parser.exit(2, f"pipeline.py: error: need --stages >= 2 and --microbatches >= --stages, got {p} and {m}\n")
    if args.timeline:
        try:
            require("matplotlib", "--timeline")
            check_output(args.timeline, "--timeline")
        except ValueError as err:
            parser.exit(2, f"pipeline.py: error: {err}\n")
    results = spawn(run_all, p, m, args.fwd_ms, timeout=600)
    print(f"p={p} stages, m={m} micro-batches, forward {args.fwd_ms:g} ms, backward {2 * args.fwd_ms:g} ms per stage")
    print(f"{'schedule':<18}{'v':>3}{'bubble':>8}{'theory':>8}   {'bubble per stage':<24}"
          f"{'peak in-flight per stage':<26}bound per stage")
    for name, (_, v) in SCHEDULES.items():
        bubbles = [r[name][0] for r in results]
        peaks = [r[name][1] for r in results]
        bounds = [inflight_bound(name, p, m, r) for r in range(p)]
        print(f"{name:<18}{v:>3}{sum(bubbles) / p:>8.3f}{theory(p, m, v):>8.3f}   "
              f"{' '.join(f'{b:.3f}' for b in bubbles):<24}{' '.join(map(str, peaks)):<26}{' '.join(map(str, bounds))}")
    if args.timeline:
        draw_timeline(results, args.timeline)
        print(f"timeline: {args.timeline}")


if __name__ == "__main__":
    main()
