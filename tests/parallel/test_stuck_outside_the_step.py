"""A stuck or dead rank outside the training step is named by the others, with the phase, as in a step.

pretrain.py runs on 2 ranks (dp 2, ``--distributed-timeout-minutes 0.25``) three times at once; in each, rank 1
stops or dies at one place, by a wrapper that patches the function there before pretrain.py runs: SIGSTOP as it
starts its first save, SIGKILL as it starts it, SIGSTOP before it joins the process group. Rank 0 must exit 1 with
one line naming rank 1 and the phase (``tpzoo.parallel.health``'s roll call), within the timeout plus a minute
of the stop. The runs mostly wait for the timeout: a background fixture of its own (``waits=True``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from pretrain_helpers import PRETRAIN, TINY, env

import background

pytestmark = pytest.mark.tier("journey")

# runs pretrain.py with MODULE.NAME replaced by one that first sends rank 1 the signal SIGNAL
WRAPPER = """
import os, runpy, signal, sys, time
import {module} as target
original = getattr(target, {name!r})
def stopped(*args, **kwargs):
    if os.environ.get("RANK") == "1":
        with open("stopped_at", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.{signal})
    return original(*args, **kwargs)
for where in (target, *[sys.modules[m] for m in {also!r}]):
    setattr(where, {name!r}, stopped)
sys.argv[0] = {program!r}
runpy.run_path({program!r}, run_name="__main__")
"""
CASES = {  # name: (module, function, also patched in, signal, the phase rank 0 names)
    "stopped-in-a-save": ("tpzoo.checkpoint.save", "save_checkpoint", ["tpzoo.checkpoint"], "SIGSTOP",
                          "saving run/iter_0000002"),
    "killed-in-a-save": ("tpzoo.checkpoint.save", "save_checkpoint", ["tpzoo.checkpoint"], "SIGKILL",
                         "saving run/iter_0000002"),
    "stopped-in-setup": ("tpzoo.parallel.mesh", "_start_process_group", [], "SIGSTOP",
                         "setting up the process groups"),
}
FLAGS = [*TINY, "--global-batch-size", "4", "--train-iters", "4", "--save-interval", "2", "--eval-interval", "0",
         "--distributed-timeout-minutes", "0.25", "--save", "run", "--dp", "2"]
LIMIT_S = 75.0  # the timeout (15 s) and the roll call, with a minute to spare on a loaded machine


@background.fixture(waits=True)
def outcomes(tmp_path_factory) -> dict[str, tuple[str, float]]:
    """name -> (the runs' stderr, seconds from rank 1's stop to rank 0's line)."""
    started, out = {}, {}
    for name, (module, function, also, sig, _) in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        (folder / "wrapper.py").write_text(WRAPPER.format(module=module, name=function, also=also, signal=sig,
                                                          program=str(PRETRAIN)))
        err = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 "wrapper.py", *FLAGS], cwd=folder, stdout=subprocess.DEVNULL, stderr=err,
                                env={**env(), "TPZOO_WARM": "0"},  # fresh (tests/warm.py): ranks found below it
                                text=True, start_new_session=True)
        started[name] = (proc, err, folder)
    try:
        deadline = time.monotonic() + 240
        while len(out) < len(started) and time.monotonic() < deadline:
            for name, (proc, err, folder) in started.items():
                err.seek(0)
                text = err.read()
                if name not in out and ("pretrain.py: error:" in text or proc.poll() is not None):
                    stop = folder / "stopped_at"
                    out[name] = (text, time.time() - float(stop.read_text()) if stop.exists() else float("inf"))
            time.sleep(0.5)
    finally:
        for proc, err, _ in started.values():
            for pid in [*descendants(proc.pid), proc.pid]:  # torchrun starts each worker in a session of its own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            err.close()
    return out


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``, children first."""
    try:
        children = [int(c) for task in os.listdir(f"/proc/{pid}/task")
                    for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
    except OSError:
        return []
    return [p for c in children for p in (c, *descendants(c))]


@pytest.mark.parametrize("name", CASES)
def test_a_stuck_or_dead_rank_outside_the_step_is_named_with_the_phase(outcomes, name):
    stderr, seconds = outcomes[name]
    lines = [line for line in stderr.splitlines() if line.startswith("pretrain.py: error:")]
    assert lines, stderr[-4000:]
    phase = CASES[name][-1]
    assert lines[0].startswith("pretrain.py: error: rank 0 ") and f" failed in {phase}: no answer from rank 1" in \
        lines[0], lines[0]
    assert "Traceback" not in stderr.split("pretrain.py: error:")[0], stderr[-4000:]  # one line, no traceback
    assert seconds < LIMIT_S, f"rank 0 named rank 1 after {seconds:.0f} s"
