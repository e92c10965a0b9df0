"""Elastic runs (docs/elastic.md): ``--elastic`` under torchrun's elastic agent.

Morphing: two agents (docs/elastic.md's line, 2 ranks each at tp 2, so dp 2) train the tiny GPT; one agent and its
workers are killed with SIGKILL mid-run: the survivor restarts at dp 1 within a minute from the newest checkpoint,
losing the iterations since it; the agent is started again: the job grows back to dp 2, losing none. Every logged
loss equals an uninterrupted run's. Idle ranks: 3 ranks at tp 2 train at dp 1, rank 2 idles. The choice of dp, the
idle ranks and the mesh-change line are unit cases.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import background
import pytest
from agent_helpers import Agent, records, wait_until
from doc_helpers import clean_env, commands
from pretrain_helpers import PRETRAIN, TINY, command, metrics, pretrain, rel
from test_multinode import free_port

from tpzoo.training.elastic import elastic_dp, mesh_change, place
from tpzoo.training.parallel_config import ParallelConfig

pytestmark = pytest.mark.tier("journey")

ITERS = 60
# larger batches than TINY's: steps long enough for a machine to come and go mid-run
FLAGS = TINY + f"--global-batch-size 32 --micro-batch-size 2 --train-iters {ITERS} --eval-interval 1000".split()
RESTART_S = 60  # the survivor's restart after the loss, at most


def _launch_line(marker: str) -> list[str]:
    """docs/elastic.md's command containing ``marker``, as words (its environment settings left out)."""
    [line] = [c for c in commands("elastic.md") if marker in c]
    words = shlex.split(line)
    return [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]


EVERY = int(_launch_line("--nnodes")[_launch_line("--nnodes").index("--save-interval") + 1])


def agent_command(port: int, job: str, save: Path, host: bool) -> list[str]:
    """One machine's launch line: docs/elastic.md's with this test's port, job id and --save/--load, the host of the
    rendezvous store named (both agents are on one machine), FLAGS after it."""
    words = _launch_line("--nnodes")
    given = {"--rdzv-endpoint": f"127.0.0.1:{port}", "--rdzv-id": job, "--save": str(save), "--load": str(save)}
    words = [given.get(before, word) for before, word in zip(["", *words], words)]
    words = [f"{w},is_host={int(host)}" if before == "--rdzv-conf" else w for before, w in zip(["", *words], words)]
    split = words.index("pretrain.py")
    return [sys.executable, "-m", "torch.distributed.run", *words[1:split], PRETRAIN, *words[split + 1:], *FLAGS]


CHANGED = re.compile(r"re-meshed: iteration (\d+) was saved on pp 1 x dp (\d) x tp 2 \(\d ranks\), the run "
                     r"goes on on pp 1 x dp (\d) x tp 2")


STOPPED = re.compile(r"stopped at iteration (\d+) of \d+: SIGTERM received")


def changes(agents: list[Agent]) -> list[tuple[int, int, int]]:
    """(iteration, dp saved at, dp now) of each mesh-change line rank 0 printed, in order."""
    return [tuple(map(int, m.groups())) for a in agents for m in CHANGED.finditer(a.text())]


@background.fixture(waits=True)
def morphing(tmp_path_factory) -> dict:
    """The uninterrupted run (one process) and the elastic job: two agents, one killed and started again."""
    root = tmp_path_factory.mktemp("elastic")
    save, port = root / "shared", free_port()
    reference = subprocess.Popen(background.niced(command(FLAGS + ["--save", "reference"])), cwd=root,
                                 env=clean_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    host = Agent(root, "host", agent_command(port, root.name, save, True))
    lost = Agent(root, "lost", agent_command(port, root.name, save, False))
    agents, seen = [host, lost], {}
    try:
        wait_until(lambda: any(r["iteration"] >= 2 * EVERY + 2 for r in records(save)), "iterations at dp 2", agents)
        seen["before_loss"] = max(r["iteration"] for r in records(save))
        lost.kill()
        seen["latest_at_loss"], seen["records_at_loss"] = (save / "latest").read_text().strip(), records(save)
        seen["restart_s"] = wait_until(lambda: len(changes(agents)) >= 1, "the restart at dp 1", agents)
        back = Agent(root, "back", agent_command(port, root.name, save, False))
        agents.append(back)
        wait_until(lambda: len(changes(agents)) >= 2, "the job grown back to dp 2", agents)
        for a in (host, back):
            assert a.proc.wait(timeout=300) == 0, a.text()[-4000:]
    finally:
        for a in agents:
            if a.proc.poll() is None:
                a.kill()
    assert reference.wait(timeout=300) == 0, reference.stderr.read()[-3000:]
    return dict(seen, root=root, save=save, agents=agents, changes=changes(agents), records=records(save))


def test_the_survivor_resumes_from_the_last_save_at_dp_1(morphing):
    (saved_at, dp_before, dp_after), _ = morphing["changes"]
    assert (dp_before, dp_after) == (2, 1), morphing["changes"]
    assert morphing["latest_at_loss"] == f"iter_{saved_at:07d}", morphing
    assert saved_at % EVERY == 0 and morphing["before_loss"] - saved_at <= EVERY, morphing  # lost: since the save
    print(f"lost at iteration {morphing['before_loss']}, resumed from {saved_at} at dp 1 "
          f"{morphing['restart_s']:.1f} s after the kill")
    assert morphing["restart_s"] <= RESTART_S, morphing["restart_s"]


def test_the_job_grows_back_losing_nothing(morphing):
    (first, _, _), (saved_at, dp_before, dp_after) = morphing["changes"]
    assert (dp_before, dp_after) == (1, 2), morphing["changes"]
    # the agent's SIGTERM: the workers saved the iteration they had reached, which the grown job resumes from
    stops = [int(i) for a in morphing["agents"] for i in STOPPED.findall(a.text())]
    assert stops == [saved_at] and saved_at > first, (stops, morphing["changes"])
    assert [r["iteration"] for r in morphing["records"]] == list(range(1, ITERS + 1))


def test_every_logged_loss_equals_the_uninterrupted_run(morphing):
    reference = metrics(morphing["root"] / "reference")
    got = morphing["records"] + morphing["records_at_loss"]  # the iterations lost to the kill too
    assert {r["iteration"] for r in got} == set(reference)
    worst = max(rel(r["loss"], reference[r["iteration"]]["loss"]) for r in got)
    print(f"largest relative loss difference, elastic job vs uninterrupted run: {worst:.2e}")
    assert worst <= 1e-5


@background.fixture
def idle(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """docs/elastic.md's 3-rank launch (tp 2: rank 2 idles) and the same run in one process."""
    root = tmp_path_factory.mktemp("idle")
    words = _launch_line("--standalone")
    flags = FLAGS[:-4] + ["--train-iters", "6"]
    words = [str(root / "idle") if before == "--save" else w for before, w in zip(["", *words], words)]
    split = words.index("pretrain.py")
    done = subprocess.run(background.niced([sys.executable, "-m", "torch.distributed.run", *words[1:split], PRETRAIN,
                                            *words[split + 1:], *flags]),
                          cwd=root, env=clean_env(1), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    pretrain(flags + ["--save", "one"], root)
    return root, done


def test_spare_ranks_idle_and_the_rest_train_the_same_run(idle):
    root, done = idle
    assert "--elastic: 3 ranks: the mesh tp 2 x pp 1 x dp 1 uses ranks 0-1, rank 2 idle" in done.stdout, done.stdout
    assert "--elastic: rank 2 idles (the mesh uses 2 of 3 ranks)" in done.stderr
    assert "mesh      tp 2 x pp 1 x dp 1 = 2 ranks" in done.stdout
    one, three = metrics(root / "one"), metrics(root / "idle")
    assert sorted(one) == sorted(three) == list(range(1, 7))
    assert max(rel(three[i]["loss"], one[i]["loss"]) for i in one) <= 1e-5


@pytest.mark.tier("unit")
@pytest.mark.parametrize("world, sizes, batch, expected", [
    (4, dict(tp=2), (32, 2), 2), (3, dict(tp=2), (32, 2), 1), (7, dict(tp=2), (32, 2), 2),  # 3 replicas: 32 % 6
    (8, dict(tp=1, ep=2), (32, 2), 8), (7, dict(tp=1, ep=2), (32, 2), 4), (16, dict(tp=2, pp=2), (8, 1), 4),
    (6, dict(tp=1, cp=2), (32, 2), 2)])
def test_elastic_dp_takes_the_largest_that_fits(world, sizes, batch, expected):
    assert elastic_dp(world, ParallelConfig(elastic=True, **sizes), *batch) == expected


@pytest.mark.tier("unit")
def test_elastic_refusals():
    with pytest.raises(ValueError, match=r"--elastic: 1 ranks cannot hold one model replica of tp x pp x cp = 2"):
        elastic_dp(1, ParallelConfig(tp=2, elastic=True), 32, 2)
    with pytest.raises(ValueError, match=r"--elastic takes dp from each launch's world size, but "
                                         r"--data-parallel-size is 2; drop --data-parallel-size"):
        ParallelConfig(dp=2, elastic=True)


@pytest.mark.tier("unit")
def test_place_sets_the_world_and_sends_spare_ranks_away(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.setenv("RANK", "0")
    assert place(ParallelConfig(tp=2, elastic=True), 32, 2) == 4 and os.environ["WORLD_SIZE"] == "4"
    assert "uses ranks 0-3, rank 4 idle" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(SystemExit) as stopped:
        place(ParallelConfig(tp=2, elastic=True), 32, 2)
    assert stopped.value.code == 0
    assert "--elastic: rank 4 idles (the mesh uses 4 of 5 ranks)" in capsys.readouterr().err


@pytest.mark.tier("unit")
def test_mesh_change_line():
    assert mesh_change({"pp": 1, "dp": 2, "tp": 2}, {"pp": 1, "dp": 2, "tp": 2}, 8) is None
    assert mesh_change({"pp": 1, "dp": 2, "tp": 2}, {"pp": 1, "dp": 1, "tp": 2}, 8) == (
        "re-meshed: iteration 8 was saved on pp 1 x dp 2 x tp 2 (4 ranks), the run goes on on pp 1 x dp 1 x "
        "tp 2 (2 ranks)")
    assert mesh_change({"pp": 1, "dp": 4, "tp": 1, "ep": 2}, {"pp": 2, "dp": 2, "tp": 1, "cp": 2}, 3) == (
        "re-meshed: iteration 3 was saved on pp 1 x dp 4 x tp 1 (4 ranks), the run goes on on pp 2 x dp 2 x "
        "cp 2 x tp 1 (8 ranks)")
