"""A stuck rank under torchrun is named within ``--distributed-timeout-minutes`` plus a minute.

pretrain.py runs on 3 ranks (dp 3) with ``--distributed-timeout-minutes 0.25``; once it has logged a few
iterations, rank 1 is SIGSTOPped (alive, its sockets open: only a timeout can tell). Every other rank
must exit non-zero, each within the timeout plus a minute of the stop, and stderr must name rank 1 (the roll call of
``tpzoo.parallel.health``); the stopped rank is then SIGKILLed. The test's cost is the timeout
itself, which it spends waiting: a background fixture of its own (``waits=True``), beside the other jobs.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from pretrain_helpers import TINY, command, env

import background

pytestmark = pytest.mark.tier("journey")



RANKS, STOPPED = 3, 1
TIMEOUT_S = 15.0  # --distributed-timeout-minutes 0.25
LIMIT_S = TIMEOUT_S + 60.0  # the timeout plus a minute


def workers(launcher: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (its children with RANK in their environment)."""
    out = {}
    for pid in map(int, Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()):
        with contextlib.suppress(OSError):
            found = re.search(rb"(?:^|\0)RANK=(\d+)\0", Path(f"/proc/{pid}/environ").read_bytes())
            if found:
                out[int(found.group(1))] = pid
    return out


def alive(pid: int) -> bool:
    """Running or stopped; gone or a zombie (exited, not yet reaped by torchrun) is not alive."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def logged(save: Path) -> int:
    path = save / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@background.fixture(waits=True)  # it mostly waits for the timeout: beside the other jobs
def stopped_run(tmp_path_factory) -> tuple[dict[int, float], dict[int, int], int, str]:
    """(rank -> seconds from the stop to its exit, rank -> pid, torchrun's exit status, stderr) of the run."""
    save = tmp_path_factory.mktemp("stopped") / "run"
    flags = [*TINY, "--global-batch-size", "6", "--train-iters", "100000", "--eval-interval", "0",
             "--distributed-timeout-minutes", str(TIMEOUT_S / 60), "--save", str(save)]
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(command(flags, (1, 1, RANKS)), cwd=save.parent, stdout=subprocess.DEVNULL, stderr=err,
                            env={**env(), "TPZOO_WARM": "0"},  # fresh (tests/warm.py): its ranks are found below it
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while logged(save) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "pretrain.py did not start training"
            time.sleep(0.2)
        ranks = workers(proc.pid)
        assert sorted(ranks) == list(range(RANKS)), ranks
        os.kill(ranks[STOPPED], signal.SIGSTOP)
        stopped_at = time.monotonic()
        others = {r: pid for r, pid in ranks.items() if r != STOPPED}
        exited: dict[int, float] = {}
        while len(exited) < len(others) and time.monotonic() - stopped_at < LIMIT_S + 30:
            exited.update({r: time.monotonic() - stopped_at for r, pid in others.items()
                           if r not in exited and not alive(pid)})
            time.sleep(0.2)
        os.kill(ranks[STOPPED], signal.SIGKILL)
        status = proc.wait(timeout=120)
        err.seek(0)
        return exited, others, status, err.read()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        err.close()


def test_a_stopped_rank_is_named_by_every_other_rank_within_the_timeout(stopped_run):
    exited, others, status, stderr = stopped_run
    assert exited.keys() == others.keys(), f"ranks {sorted(others.keys() - exited.keys())} still running " \
                                           f"{LIMIT_S + 30:.0f}s after the stop:\n{stderr[-3000:]}"
    assert max(exited.values()) < LIMIT_S, f"exits after the stop, by rank: {exited}"
    assert status != 0, "torchrun exited 0 with a rank stuck"
    for rank in others:  # torchrun's summary: each rank's exit status (a survivor's own, or its SIGTERM)
        code = re.search(rf"rank\s+: {rank} \(local_rank: {rank}\)\s+exitcode\s+: (-?\d+)", stderr)
        assert code and int(code.group(1)) != 0, f"rank {rank} exited 0 or unreported:\n{stderr[-3000:]}"
        assert re.search(rf"rank {rank} \(ParallelMesh\(.*\) failed in .*: no answer from [^;]*rank {STOPPED} "
                         rf"\(pp_rank=0, dp_rank={STOPPED}, tp_rank=0\)", stderr), \
            f"rank {rank} did not name rank {STOPPED}:\n{stderr[-4000:]}"
