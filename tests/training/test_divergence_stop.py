"""A diverging run stops: ``--lr 1e4`` makes the tiny GPT's loss or gradient norm non-finite from its
second step on, in fp32, bf16 and fp16 (where the loss scale first backs off to its minimum).

The three pretrain.py runs go at once (module fixture), saving every iteration; finetune.py then
diverges from the fp32 run's last checkpoint. Each must exit 1 after ``--max-skipped-steps`` skipped
steps in a row with one line on stderr naming the iteration, the count, the checkpoint that trains on
and what to do, leave ``latest`` on a checkpoint whose tensors are all finite, and log strict JSON with
``skipped`` and ``loss_scale`` on every line.

Beside them: ``--lr 1e6``, whose third step's loss is finite but exploded (about 4e12): the line must
name a checkpoint saved before it, one that resumes at a sane --lr with finite losses, not the exploded
one; a checkpoint holding a NaN weight is refused at load by pretrain.py and tpzoo.generate, one line,
exit 2; and ``--fp16 --loss-scale 1e-30``, whose gradients all underflow to zero: the zero steps are
named and ``--max-skipped-steps`` of them stop the run like a divergence.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
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
EXPLODE, STALL = "explode", "stall"


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
    commands += [command(TINY + f"--lr 1e6 --train-iters 30 --save-interval 1 --save {EXPLODE}".split()),
                 command(TINY + f"--fp16 --loss-scale 1e-30 --train-iters 30 --save-interval 5 --save {STALL}".split())]
    # three at once; the fine-tuning starts once the fp32 run it loads has ended
    return root, dict(zip([*PRECISIONS, "finetune", EXPLODE, STALL], run_as_needed(list(map(shlex.join, commands)), root, slots=3,
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
    named = re.fullmatch(rf"the last checkpoint that trains on is {precision}/(iter_\d+)( \(.*\))?; resume from it",
                         found.group(3))
    assert named, found.group(3)
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
    good = int(named.group(1).split("_")[1])  # the named checkpoint: the step after it had a sane loss
    assert good <= saved and math.isfinite(log[good + 1]["loss"]) and log[good + 1]["loss"] <= 2 * log[1]["loss"]
    for folder in {latest, named.group(1)}:
        tensors = finite_tensors(root / precision / folder)
        assert tensors and all(tensors.values()), [k for k, ok in tensors.items() if not ok]


def test_finetune_divergence_exits_1_with_one_line(runs):
    root, done = runs[0], runs[1]["finetune"]
    found = diverged_line(done, 2)
    assert found.group(3) == "no checkpoint was saved; fine-tune fp32 again"
    assert not list((root / "finetune").glob("iter_*"))
    log = strict((root / "finetune" / "metrics.jsonl").read_text())
    assert [r["iteration"] for r in log] == list(range(1, int(found.group(1)) + 1))
    assert [r["skipped"] for r in log][-2:] == [True, True]


def test_an_exploded_checkpoint_is_not_the_one_named(runs):
    """--lr 1e6: step 3's loss is finite but about 4e12 (the weights after update 2 blew up); the line names the
    checkpoint before the explosion, which resumes at --lr 1e-3 with finite losses, and why the later one is not."""
    root, done = runs[0], runs[1][EXPLODE]
    found = diverged_line(done, LIMIT)
    log = strict((root / EXPLODE / "metrics.jsonl").read_text())
    exploded = next(r["iteration"] for r in log if r["loss"] is None or r["loss"] > 1000)
    named = re.fullmatch(rf"the last checkpoint that trains on is {EXPLODE}/iter_(\d+) \({EXPLODE}/iter_(\d+) gave "
                         rf"(a non-finite loss|loss [0-9.e+]+, over 2x the run's first [0-9.]+) at iteration (\d+)\); "
                         r"resume from it", found.group(3))
    assert named, found.group(3)
    # checkpoint k holds the weights after update k, so step k + 1 judges it: the refuted one is judged no later
    # than the loss exploded, and a later one than the named one exists
    good, bad, judged = int(named.group(1)), int(named.group(2)), int(named.group(4))
    assert good < bad and judged == bad + 1 <= exploded and (root / EXPLODE / f"iter_{bad:07d}").is_dir()
    resumed = run_as_needed([shlex.join(command(TINY + f"--lr 1e-3 --train-iters {good + 3} --load "
                                                       f"{EXPLODE}/iter_{good:07d} --save resumed".split()))], root)[0]
    losses = [r["loss"] for r in strict((root / "resumed" / "metrics.jsonl").read_text())]
    assert len(losses) == 3 and all(math.isfinite(x) and x < 2 * log[0]["loss"] for x in losses), resumed.stdout


def nan_copy(src: Path, dst: Path) -> str:
    """A copy of the checkpoint ``src`` at ``dst`` with one NaN in its first model weight, manifest included (as a
    run that saved it would have written it); returns that weight's key."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from tpzoo.checkpoint.manifest import write_manifest

    entries = read_dcp_metadata(src).state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in entries.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says so
        load_tensors(state, src)
        key = next(k for k in sorted(state) if k.startswith("model.") and state[k].is_floating_point())
        state[key].view(-1)[0] = float("nan")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dst))
    for f in src.iterdir():
        if not f.name.endswith(".distcp") and f.name not in (".metadata", "manifest.json"):
            shutil.copy(f, dst / f.name)
    write_manifest(dst, {}, tuple(sorted(f.name for f in dst.iterdir())))
    return key


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # nan_copy reads and writes in this process
def test_a_checkpoint_with_a_nan_weight_is_refused_at_load(runs):
    root = runs[0]
    key = nan_copy(root / "fp32" / "iter_0000001", root / "nan")
    commands = {"pretrain.py": command(TINY + "--lr 1e-3 --train-iters 3 --load nan --save nan-resumed".split()),
                "python -m tpzoo.generate": [sys.executable, "-m", "tpzoo.generate", "--load", "nan", "--prompt", "hi"]}
    for prog, done in zip(commands, run_as_needed(list(map(shlex.join, commands.values())), root, check=False)):
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert lines[0] == (f"{prog}: error: checkpoint nan holds 1 non-finite (NaN or inf) value, 1 of them in {key}: "
                            f"the run diverged before it was saved, and it cannot train or generate; load an earlier "
                            f"checkpoint (the line that stopped the run names one)"), lines[0]
    assert not (root / "nan-resumed").exists() or not list((root / "nan-resumed").glob("iter_*"))


def test_steps_with_all_gradients_zero_are_named_and_stop_the_run(runs):
    """--fp16 --loss-scale 1e-30: every gradient underflows to zero, so nothing is learned; the first such step is
    named, and --max-skipped-steps of them in a row stop the run like a divergence (exit 1, one line)."""
    root, done = runs[0], runs[1][STALL]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "iteration 1: every gradient is zero (gradient norm 0); the step changes no weight" in done.stdout
    line = done.stderr.strip().splitlines()[-1]
    assert line == (f"training stalled at iteration {LIMIT}: {LIMIT} steps in a row with every gradient zero, which "
                    f"learn nothing (--max-skipped-steps {LIMIT}, loss scale 1e-30); the last checkpoint that trains "
                    f"on is {STALL}/iter_0000005; resume from it with a loss scale the gradients do not underflow in "
                    f"(a larger --loss-scale, or none: dynamic scaling), or --bf16 instead of --fp16"), line
    log = strict((root / STALL / "metrics.jsonl").read_text())
    assert [r["grad_norm"] for r in log] == [0.0] * LIMIT
