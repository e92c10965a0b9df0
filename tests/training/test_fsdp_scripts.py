"""``--use-torch-fsdp2`` on pretrain.py and finetune.py, end to end (CPU, gloo).

One background fixture runs, in one folder, each command once those whose folders it reads are done:
``full``: pretrain.py in one process without the flag, 6 iterations (validation every 2);
``fsdp``: the same run under torchrun at (tp, pp, dp) = FSDP_MESH with the flag and FSDP_EXTRA, stopped
and saved after iteration 4 (``--exit-interval 4``);
``resumed``: pretrain.py in one process, without the flag, ``--load fsdp``: on to iteration 6;
``ft-fsdp`` / ``ft-plain``: finetune.py of ``full``'s GPT (a checkpoint saved without FSDP) on a few jsonl
texts at dp 2 with the flag, and in one process without it.
In float32 without dropout each pair logs the same losses within 1e-5 (the same-loss guarantee: FSDP
changes where the weights live, not the math); that the flag took effect is read from the plan each
checkpoint records (meta.json).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import background
import pytest
from doc_helpers import ROOT, run_as_needed
from pretrain_helpers import TINY, command, metrics, rel

from tpzoo.data.demo import demo_task

pytestmark = pytest.mark.tier("journey")



ITERS, STOP = 6, 4
RUN = [*TINY, "--train-iters", str(ITERS), "--eval-interval", "2", "--eval-iters", "1"]
FSDP_MESH = (2, 1, 2)  # tp 2: FSDP's dp shards of the tp shards; --sequence-parallel and recompute on top
FSDP_EXTRA = ["--sequence-parallel", "--recompute-activations"]
FINETUNE = ["--epochs", "1", "--global-batch-size", "8", "--micro-batch-size", "2", "--seq-length", "16",
            "--log-interval", "1", "--train-data", "train.jsonl", "--valid-data", "valid.jsonl", "--load", "full"]


def finetune(flags: list[str], dp: int = 1) -> list[str]:
    script = [str(ROOT / "finetune.py"), *FINETUNE, *flags]
    if dp == 1:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp}", *script]


@background.fixture
def runs(tmp_path_factory) -> dict:
    """The folder the runs wrote into, and each run's stdout by name."""
    root = tmp_path_factory.mktemp("fsdp-scripts")
    texts = [json.loads(line) for line in Path(demo_task()[0]).read_text().splitlines()[:40]]
    for name, rows in (("train", texts[:32]), ("valid", texts[32:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in rows))
    commands = {
        "full": command([*RUN, "--save", "full"]),
        "fsdp": command([*RUN, *FSDP_EXTRA, "--use-torch-fsdp2", "--exit-interval", str(STOP), "--save", "fsdp"],
                        FSDP_MESH),
        "resumed": command(["--load", "fsdp", "--save", "resumed"]),
        "ft-fsdp": finetune(["--use-torch-fsdp2", "--save", "ft-fsdp"], dp=2),
        "ft-plain": finetune(["--log-dir", "ft-plain"]),
    }
    done = run_as_needed([shlex.join(c) for c in commands.values()], root)
    return dict(root=root, stdout={name: d.stdout for name, d in zip(commands, done)})


def recorded_fsdp(checkpoint: Path) -> bool:
    """The ``fsdp`` of the plan the checkpoint's model was built with."""
    return json.loads((checkpoint / "meta.json").read_text())["checkpoint"]["model"]["plan"]["fsdp"]


def assert_same(got: dict[int, dict], want: dict[int, dict], keys: tuple[str, ...]) -> float:
    """Every ``keys`` value of ``got`` (metrics by iteration) within 1e-5 relative of ``want``'s; the largest gap."""
    pairs = [(i, k) for i in got for k in keys if k in want[i]]
    assert pairs, "nothing to compare"
    worst = max(rel(got[i][k], want[i][k]) for i, k in pairs)
    assert worst <= 1e-5, {(i, k): (got[i][k], want[i][k]) for i, k in pairs}
    return worst


def test_pretrain_with_fsdp_logs_the_unsharded_losses(runs):
    """At FSDP_MESH with --sequence-parallel --recompute-activations: the single-process losses, gradient
    norms and validation losses, iteration by iteration, and a checkpoint at the --exit-interval stop."""
    full, fsdp = metrics(runs["root"] / "full"), metrics(runs["root"] / "fsdp")
    assert sorted(fsdp) == list(range(1, STOP + 1)), runs["stdout"]["fsdp"]
    worst = assert_same(fsdp, full, ("loss", "grad_norm", "val_loss"))
    print(f"FSDP at {FSDP_MESH}: largest relative difference {worst:.1e}")
    assert (runs["root"] / "fsdp" / "latest").read_text().strip() == f"iter_{STOP:07d}"
    assert recorded_fsdp(runs["root"] / "fsdp" / f"iter_{STOP:07d}") is True


def test_fsdp_checkpoint_resumes_without_the_flag(runs):
    """An FSDP checkpoint loads in one process without the flag: the val loss right after loading and the
    losses of the iterations after it are the uninterrupted run's."""
    full, resumed = metrics(runs["root"] / "full"), metrics(runs["root"] / "resumed")
    out = runs["stdout"]["resumed"]
    found = re.search(rf"resumed from \S+ at iteration {STOP} \(consumed samples \d+\): val loss (\S+)", out)
    assert found, out
    assert rel(float(found.group(1)), full[STOP]["val_loss"]) <= 1e-5, (found.group(1), full[STOP]["val_loss"])
    assert sorted(resumed) == list(range(STOP + 1, ITERS + 1)), out
    assert_same(resumed, full, ("loss", "grad_norm", "val_loss"))
    assert recorded_fsdp(runs["root"] / "resumed" / f"iter_{ITERS:07d}") is False  # --load never restores the flag


def test_finetune_with_fsdp_logs_the_unsharded_losses(runs):
    """finetune.py loads a checkpoint saved without FSDP into its sharded model and logs the unsharded losses."""
    assert recorded_fsdp(runs["root"] / "ft-fsdp" / "best") is True
    plain, fsdp = (metrics(runs["root"] / name) for name in ("ft-plain", "ft-fsdp"))
    assert sorted(fsdp) == sorted(plain) and len(plain) >= 3, (sorted(fsdp), sorted(plain))
    assert_same(fsdp, plain, ("loss", "val_loss"))
