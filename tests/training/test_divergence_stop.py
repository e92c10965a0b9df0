"""A diverging run stops: ``--lr 1e4`` makes the tiny GPT's loss or gradient norm non-finite from its
second step on, in fp32, bf16 and fp16 (where the loss scale first backs off to its minimum).

The three pretrain.py runs go at once (module fixture), saving every iteration; finetune.py then
diverges from the fp32 run's last checkpoint. Each must exit 1 after ``--max-skipped-steps`` skipped
steps in a row with one line on stderr naming the iteration, the count and what to do, leave
``latest`` on a checkpoint whose tensors are all finite, and log strict JSON with ``skipped`` and
``loss_scale`` on every line.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
from pathlib import Path

import pytest
from doc_helpers import ROOT, run_as_needed
from pretrain_helpers import TINY, command
from test_preemption import write_text_files

from tpzoo.checkpoint.reader import load_tensors, read_dcp_metadata

pytestmark = pytest.mark.tier("journey")



PRECISIONS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "16"]}  # 4 halvings to 1
FLAGS = TINY + "--lr 1e4 --train-iters 60 --eval-interval 20 --eval-iters 1 --save-interval 1".split()
LIMIT = 10  # --max-skipped-steps' default


def strict(text: str) -> list[dict]:
    """The lines of a metrics.jsonl, refusing NaN and Infinity (not JSON)."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} in metrics.jsonl")
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def finite_tensors(folder: Path) -> dict[str, bool]:
    """Whether each tensor of the checkpoint ``folder`` is all finite (read without a process group)."""
    import torch

    entries = read_dcp_metadata(folder).state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in entries.items()}
    load_tensors(state, folder)
    return {key: bool(torch.isfinite(t).all()) if t.is_floating_point() else True for key, t in state.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("diverge")
    ft = [sys.executable, str(ROOT / "finetune.py"), "--load", "fp32", *write_text_files(root), "--epochs", "2",
          "--global-batch-size", "8", "--micro-batch-size", "4", "--seq-length", "16", "--log-interval", "1",
          "--lr", "1e4", "--lr-warmup-iters", "0", "--max-skipped-steps", "2", "--save", "finetune"]
    commands = [command(FLAGS + flags + ["--save", name]) for name, flags in PRECISIONS.items()] + [ft]
    # three at once; the fine-tuning starts once the fp32 run it loads has ended
    return root, dict(zip([*PRECISIONS, "finetune"], run_as_needed(list(map(shlex.join, commands)), root, slots=3,
                                                                  check=False)))


def diverged_line(done, limit: int) -> re.Match:
    """The run exited 1 with its last stderr line saying so (the only one that does), no traceback."""
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and sum("training diverged" in line for line in lines) == 1, done.stderr
    found = re.fullmatch(rf"training diverged at iteration (\d+): {limit} steps in a row skipped for a non-finite "
                         rf"loss or gradient norm \(--max-skipped-steps {limit}(, loss scale 1)?\); (.*) with a lower "
                         r"--lr, a longer --lr-warmup-iters or --clip-grad, or --bf16 instead of --fp16", lines[-1])
    assert found, lines[-1]
    return found


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # finite_tensors reads in this process
@pytest.mark.parametrize("precision", PRECISIONS)
def test_divergence_exits_1_with_one_line_and_latest_finite(runs, precision):
    root, done = runs[0], runs[1][precision]
    found = diverged_line(done, LIMIT)
    stop = int(found.group(1))
    latest = (root / precision / "latest").read_text().strip()
    assert found.group(3) == f"the last finite checkpoint is {precision}/{latest}; resume from it"
    log = {r["iteration"]: r for r in strict((root / precision / "metrics.jsonl").read_text())}
    saved = int(latest.split("_")[1])
    print(f"{precision}: stopped at iteration {stop}, latest {latest}, loss scale {log[stop]['loss_scale']}")
    assert sorted(log) == list(range(1, stop + 1)) and saved < stop - LIMIT + 1
    assert all(log[i]["skipped"] for i in range(stop - LIMIT + 1, stop + 1))
    assert sorted(p.name for p in (root / precision).glob("iter_*"))[-1] == latest  # nothing saved after it
    assert all(isinstance(r["skipped"], bool) and isinstance(r["loss_scale"], float) for r in log.values())
    assert all(r["loss_scale"] == 1.0 for r in log.values()) if precision != "fp16" else log[stop]["loss_scale"] == 1.0
    updated = [i for i in log if not log[i]["skipped"]]  # the steps that changed the weights: finite losses
    assert updated and all(math.isfinite(log[i]["loss"]) for i in updated) and max(updated) <= saved
    tensors = finite_tensors(root / precision / latest)
    assert tensors and all(tensors.values()), [k for k, ok in tensors.items() if not ok]


def test_finetune_divergence_exits_1_with_one_line(runs):
    root, done = runs[0], runs[1]["finetune"]
    found = diverged_line(done, 2)
    assert found.group(3) == "no checkpoint was saved; fine-tune fp32 again"
    assert not list((root / "finetune").glob("iter_*"))
    log = strict((root / "finetune" / "metrics.jsonl").read_text())
    assert [r["iteration"] for r in log] == list(range(1, int(found.group(1)) + 1))
    assert [r["skipped"] for r in log][-2:] == [True, True]
