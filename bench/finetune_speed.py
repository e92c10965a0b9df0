"""Fine-tuning's tokens/s against pretraining's, the same model and batch shapes, measured in one run.

    python bench/finetune_speed.py                 # gpt-tiny, 64-token sequences, batches of 32 (8 per micro-batch)
    python bench/finetune_speed.py --iters 2 --steps 2 --seq-length 32 --global-batch-size 8   # the test's run

Runs, one after another in one process each, as a user types them: ``pretrain.py`` (the demo corpus) for
``--iters`` steps, saving the model; then ``finetune.py --load`` of it, one epoch each route (or ``--steps``:
``--exit-interval``) at the same
``--seq-length``, ``--global-batch-size`` and ``--micro-batch-size``: a causal LM on the demo text files, instruction
tuning on the demo instructions (packed) and a classifier on the demo sentiment task (each sample padded to the
sequence length). Each run's tokens/s is the last line of its metrics.jsonl: tokens stepped over the seconds of its
train steps (``Metrics.step``; data reading, evaluation and saving not counted), so the ratio compares the steps.
Prints one row per run and its ratio to pretraining; CPU figures are ratios only (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tpzoo.data import demo_files  # noqa: E402


def routes() -> dict[str, list[str]]:
    """finetune.py's data flags of each route."""
    text, instructions = demo_files("text"), demo_files("instructions")
    return {"causal LM (text)": ["--train-data", text[0], "--valid-data", text[1]],
            "instruction tuning": ["--train-data", instructions[0], "--valid-data", instructions[1]],
            "classifier (demo task)": ["--task", "demo"]}


def run(script: str, flags: list[str], folder: Path) -> float:
    """Run ``script`` with ``flags`` (its metrics into ``folder``); its tokens/s."""
    done = subprocess.run([sys.executable, str(ROOT / script), *flags], capture_output=True, text=True, cwd=folder)
    if done.returncode != 0:
        raise SystemExit(f"{script} {' '.join(flags)} failed:\n{done.stderr[-3000:]}")
    lines = (folder / flags[flags.index("--save") + 1] / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["tokens_per_sec"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=30, help="pretraining steps (fine-tuning: one epoch of each route)")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="fine-tuning steps of each route (default: one epoch)")
    args = p.parse_args(argv)
    if min(args.iters, args.seq_length, args.global_batch_size, args.micro_batch_size, args.steps or 1) < 1:
        p.error("--iters, --seq-length, --global-batch-size, --micro-batch-size and --steps must be >= 1")
    stop = ["--exit-interval", str(args.steps)] if args.steps else []
    shape = ["--seq-length", str(args.seq_length), "--global-batch-size", str(args.global_batch_size),
             "--micro-batch-size", str(args.micro_batch_size), "--log-interval", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        speeds = {"pretraining": run("pretrain.py", [*shape, "--train-iters", str(args.iters), "--eval-interval", "0",
                                                     "--save", "base"], folder)}
        for i, (name, data) in enumerate(routes().items()):
            speeds[name] = run("finetune.py", [*shape, "--load", "base", *data, "--epochs", "1", *stop,
                                               "--save", f"tune{i}"], folder)
    print(f"gpt-tiny, {args.seq_length}-token sequences, global batch {args.global_batch_size} "
          f"(micro-batch {args.micro_batch_size}); one process each")
    print("| run | tokens/s | x pretraining |\n| --- | ---: | ---: |")
    for name, speed in speeds.items():
        print(f"| {name} | {speed:,.0f} | {speed / speeds['pretraining']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
