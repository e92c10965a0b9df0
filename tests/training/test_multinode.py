"""pretrain.py on two "nodes": two torchrun launchers started at once on this machine, each with
``--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d``, meet at one rendezvous endpoint and train the
tiny GPT at (tp, pp, dp) = (2, 1, 2), each from its own working folder (its "node"), saving into
one shared absolute --save folder (docs/multinode.md). Checked: the losses equal a single-process
run's, the checkpoint holds the shards of the ranks of both launchers (which launcher got which
global ranks is read from torchrun's own log), and a single process resumes from it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import background
import pytest
from doc_helpers import clean_env, commands
from pretrain_helpers import PRETRAIN, TINY, command, metrics, pretrain, rel

pytestmark = pytest.mark.tier("journey")



ITERS, SAVED = 4, 2
FLAGS = TINY + f"--train-iters {ITERS} --eval-interval 2 --eval-iters 1 --save-interval {SAVED}".split()
NODES = 2  # launchers, as the docs line says (--nnodes 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(port: int, job: str, save: Path) -> list[str]:
    """One node's launch line: docs/multinode.md's (2 nodes x 2 ranks at tp 2 x dp 2) with this test's
    port, job id and --save, the tiny model's flags after it."""
    [line] = commands("multinode.md")
    words = shlex.split(line)
    assert words[0] == "torchrun" and "pretrain.py" in words, line
    given = {"--rdzv-endpoint": f"127.0.0.1:{port}", "--rdzv-id": job, "--save": str(save)}
    words = [given.get(before, word) for before, word in zip(["", *words], words)]
    split = words.index("pretrain.py")
    return [sys.executable, "-m", "torch.distributed.run", *words[1:split], "--rdzv-conf", "join_timeout=120",
            PRETRAIN, *words[split + 1:], *FLAGS]


def launch_nodes(root: Path) -> list[subprocess.CompletedProcess]:
    """Both launchers at once, each in root/node<k>; torchrun's INFO log (LOGLEVEL) names each node's ranks.
    A launcher that fails ends the other (it would wait for its peer until the rendezvous timed out)."""
    port, job = free_port(), root.name
    env = {**clean_env(1), "LOGLEVEL": "INFO"}
    with contextlib.ExitStack() as files:
        procs = []
        for k in range(NODES):
            (root / f"node{k}").mkdir()
            out, err = (files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
            procs.append((subprocess.Popen(background.niced(launcher(port, job, root / "shared")),
                                           cwd=root / f"node{k}", env=env, stdout=out, stderr=err,
                                           start_new_session=True), out, err))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and any(p.poll() is None for p, _, _ in procs):
            if any(p.poll() for p, _, _ in procs):
                break
            time.sleep(0.2)
        for proc, _, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        done = []
        for proc, out, err in procs:
            out.seek(0), err.seek(0)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()))
    for d in done:
        assert d.returncode == 0, f"a launcher failed:\n{d.stdout[-2000:]}\n{d.stderr[-4000:]}"
    return done


@background.fixture
def nodes(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess], subprocess.CompletedProcess]:
    """The two launchers beside the reference run (one process), then a single-process resume from their
    checkpoint at iteration SAVED."""
    root = tmp_path_factory.mktemp("multinode")
    with tempfile.TemporaryFile("w+") as err:
        single = subprocess.Popen(background.niced(command(FLAGS + ["--save", "single"])), cwd=root,
                                  env=clean_env(1), stdout=subprocess.DEVNULL, stderr=err)
        try:
            launched = launch_nodes(root)
        finally:
            code = single.wait(timeout=300)
        err.seek(0)
        assert code == 0, err.read()[-3000:]
    resumed = pretrain(FLAGS + ["--load", str(root / "shared" / f"iter_{SAVED:07d}"), "--save", "resumed"], root)
    return root, launched, resumed


def test_two_launchers_log_the_single_process_losses(nodes):
    root, _, _ = nodes
    one, two = metrics(root / "single"), metrics(root / "shared")
    assert sorted(one) == sorted(two) == list(range(1, ITERS + 1))
    worst = max(rel(two[i][k], one[i][k]) for i in one for k in ("loss", "val_loss") if k in one[i])
    print(f"largest relative loss difference, 2 nodes x 2 ranks vs 1 process: {worst:.2e}")
    assert worst <= 1e-5
    assert [one[i]["lr"] for i in one] == [two[i]["lr"] for i in one]


def test_checkpoint_holds_the_shards_of_both_launchers(nodes):
    root, launched, _ = nodes
    ranks = []
    for done in launched:
        found = re.search(r"global_ranks=\[([\d, ]+)\]", done.stderr)
        assert found, done.stderr[-3000:]
        ranks.append(sorted(int(r) for r in found.group(1).split(",")))
    assert sorted(ranks) == [[0, 1], [2, 3]], ranks
    for folder in (root / "shared" / f"iter_{k:07d}" for k in (SAVED, ITERS)):
        manifest = (folder / "manifest.json").read_text()
        for node_ranks in ranks:
            for r in node_ranks:
                shard = next(folder.glob(f"__{r}_*.distcp"), None)
                assert shard is not None and shard.name in manifest, (r, sorted(p.name for p in folder.iterdir()))
    assert (root / "shared" / "latest").read_text().strip() == f"iter_{ITERS:07d}"
    outside = [p for k in range(NODES) for p in (root / f"node{k}").iterdir()]
    assert not outside, f"a node wrote outside the shared --save: {outside}"


def test_single_process_resumes_from_the_two_node_checkpoint(nodes):
    root, _, resumed = nodes
    assert re.search(rf"resumed from \S+ at iteration {SAVED} \(consumed samples 16\)", resumed.stdout), resumed.stdout
    one, again = metrics(root / "single"), metrics(root / "resumed")
    assert sorted(again) == list(range(SAVED + 1, ITERS + 1))
    worst = max(rel(again[i][k], one[i][k]) for i in again for k in ("loss", "val_loss") if k in one[i])
    assert worst <= 1e-5, worst
