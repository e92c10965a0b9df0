"""Per-step fault tolerance (``--fault-tolerance``, docs/elastic.md): docs/elastic.md's lighthouse and replica-group
lines with the tiny GPT at tp 2, two groups of 2 ranks.

No failure: every logged loss equals plain dp 2 x tp 2's (one torchrun of 4 ranks) within 1e-5.
A failure: group 0 starts, group 1 joins it (recovering its state), and is killed with SIGKILL mid-run; group 0
keeps stepping without a restart, each step logged with the groups live (``live_replicas 1``); group 1 started again
recovers from group 0 (weights, optimizer state, data position) and joins; from there both groups log the same
numbers, and their last checkpoints hold bit-identical weights, optimizer state and RNG states. Until group 1 is
back a test hook slows group 0's steps (its batch reads sleep while a file exists), so that group 0 is still running
when group 1 is back however slowly it starts.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import background
import pytest
import torch
from agent_helpers import Agent, records, wait_until
from doc_helpers import clean_env, commands
from pretrain_helpers import PRETRAIN, TINY, rel
from test_multinode import free_port
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tpzoo.engine.fault_tolerance import ReplicaGroups

pytestmark = pytest.mark.tier("journey")

ITERS, EQUAL_ITERS, TOGETHER, HELD_S = 200, 8, 3, 1.0
FLAGS = TINY + ["--eval-interval", "1000"]
RECOVERED = re.compile(r"replica group 1 recovered from a live group: iteration (\d+) \(it was at (\d+)\)")
# loaded by every Python process of group 0 (PYTHONPATH): its train batch reads sleep while the file $HOLD exists
HOOK = f'''
import os
if os.environ.get("HOLD") and os.environ.get("LOCAL_RANK") is not None:
    import time
    from tpzoo.training import setup
    read = setup.Run.batch
    def held(self, dataset, start, size=None):
        if dataset is self.train and os.path.exists(os.environ["HOLD"]):
            time.sleep({HELD_S})
        return read(self, dataset, start, size)
    setup.Run.batch = held
'''


def doc_line(marker: str) -> list[str]:
    """docs/elastic.md's command containing ``marker``, as words."""
    [line] = [c for c in commands("elastic.md") if marker in c]
    return shlex.split(line)


def replace(words: list[str], values: dict[str, str]) -> list[str]:
    """``words`` with the word after each flag of ``values`` replaced by its value."""
    return [values.get(before, word) for before, word in zip(["", *words], words)]


def lighthouse(root: Path, port: int, min_replicas: int) -> subprocess.Popen:
    """docs/elastic.md's lighthouse on ``port``, a quorum from ``min_replicas`` groups on."""
    words = replace(doc_line("torchft_lighthouse"), {"--bind": f"[::]:{port}", "--min_replicas": str(min_replicas)})
    words[0] = str(Path(sys.executable).parent / words[0])
    out = open(root / f"lighthouse-{port}.log", "w")
    return subprocess.Popen(words, cwd=root, stdout=out, stderr=subprocess.STDOUT, env=clean_env(1))


def group(root: Path, name: str, index: int, lighthouse_port: int, iters: int, env: dict[str, str] | None = None
          ) -> Agent:
    """docs/elastic.md's launch of replica group ``index`` with this test's ports and folder, FLAGS and ``iters``
    after it."""
    words = doc_line(f"--ft-replica-id {index}")
    [setting] = [w for w in words if w.startswith("TORCHFT_LIGHTHOUSE=")]
    save = str(root / f"group{index}")
    words = replace(words[1:], {"--master-port": str(free_port()), "--save": save, "--load": save})
    split = words.index("pretrain.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", *words[1:split], PRETRAIN, *words[split + 1:], *FLAGS,
           "--train-iters", str(iters)]
    address = re.sub(r":\d+$", f":{lighthouse_port}", setting.split("=", 1)[1])
    return Agent(root, name, cmd, {"TORCHFT_LIGHTHOUSE": address, **(env or {})})


def stop(processes: list) -> None:
    for p in processes:
        if isinstance(p, Agent) and p.proc.poll() is None:
            p.kill()
        elif isinstance(p, subprocess.Popen) and p.poll() is None:
            p.kill()


@background.fixture(waits=True)
def no_failure(tmp_path_factory) -> dict:
    """Both groups for EQUAL_ITERS iterations (the lighthouse waits for both), and plain dp 2 x tp 2 in one
    torchrun."""
    root = tmp_path_factory.mktemp("ft-equal")
    port = free_port()
    house = lighthouse(root, port, 2)
    groups = [group(root, f"group{i}", i, port, EQUAL_ITERS) for i in range(2)]
    try:
        for g in groups:
            assert g.proc.wait(timeout=300) == 0, g.text()[-4000:]
    finally:
        stop([*groups, house])
    flags = FLAGS + ["--train-iters", str(EQUAL_ITERS), "--save", str(root / "plain")]
    plain = subprocess.run(background.niced([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                             "--nproc-per-node=4", PRETRAIN, "--tp", "2", *flags]),
                           cwd=root, env=clean_env(1), capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    return {name: records(root / name) for name in ("group0", "group1", "plain")}


def test_with_no_failure_the_losses_equal_plain_dp(no_failure):
    plain = {r["iteration"]: r["loss"] for r in no_failure["plain"]}
    for name in ("group0", "group1"):
        got = no_failure[name]
        assert [r["iteration"] for r in got] == list(range(1, EQUAL_ITERS + 1)), got
        assert {r["live_replicas"] for r in got} == {2}, got
        worst = max(rel(r["loss"], plain[r["iteration"]]) for r in got)
        print(f"{name}: largest relative loss difference against plain dp 2 x tp 2: {worst:.2e}")
        assert worst <= 1e-5


@background.fixture(waits=True)
def failure(tmp_path_factory) -> dict:
    """Group 0 throughout; group 1 joining it, killed after TOGETHER steps together, and started again."""
    root = tmp_path_factory.mktemp("ft-kill")
    (root / "hook").mkdir()
    (root / "hook" / "sitecustomize.py").write_text(HOOK)
    hold, port = root / "hold", free_port()
    hold.touch()  # group 0 slowed until group 1 is back for good
    house = lighthouse(root, port, 1)
    survivor = group(root, "group0", 0, port, ITERS, {"PYTHONPATH": str(root / "hook"), "HOLD": str(hold)})
    processes, seen = [house, survivor], {}
    try:
        wait_until(lambda: records(root / "group0"), "group 0 stepping", [survivor])
        lost = group(root, "group1", 1, port, ITERS)
        processes.append(lost)
        both = [survivor, lost]
        wait_until(lambda: sum(r["live_replicas"] == 2 for r in records(root / "group1")) >= TOGETHER,
                   "both groups stepping", both)
        seen["joined"] = RECOVERED.search(lost.text()) is not None
        lost.kill()
        seen["killed_after"] = max(r["iteration"] for r in records(root / "group1"))
        wait_until(lambda: any(r["live_replicas"] == 1 for r in records(root / "group0")), "group 0 alone", both)
        back = group(root, "back", 1, port, ITERS)
        processes.append(back)
        wait_until(lambda: RECOVERED.search(back.text()), "group 1 recovered", [survivor, back])
        hold.unlink()
        for g in (survivor, back):
            assert g.proc.wait(timeout=300) == 0, g.text()[-4000:]
    finally:
        stop(processes)
    return dict(seen, root=root, survivor=survivor.text(), back=back.text(), group0=records(root / "group0"),
                group1=records(root / "group1"))


def test_the_survivor_steps_on_without_a_restart(failure):
    got = failure["group0"]
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1)), [r["iteration"] for r in got]
    assert "resumed from" not in failure["survivor"] and failure["joined"]  # group 1's first start healed too
    live = [r["live_replicas"] for r in got]
    together = live.index(2)  # group 1 joined
    alone = [i for i in range(together, len(live)) if live[i] == 1]  # after the kill
    assert alone and 2 in live[alone[-1]:], live
    print(f"group 1 joined at iteration {got[together]['iteration']}, was killed after {failure['killed_after']}; "
          f"group 0 stepped alone for {len(alone)} iterations ({got[alone[0]]['iteration']} to "
          f"{got[alone[-1]]['iteration']}) until it was back")


def test_the_killed_group_recovers_from_its_peer_and_joins(failure):
    at, was = map(int, RECOVERED.search(failure["back"]).groups())
    assert was < at and at > failure["killed_after"], (at, was)  # afresh, or from a checkpoint of its own
    back = [r for r in failure["group1"] if r["iteration"] > at]
    assert [r["iteration"] for r in back][-1] == ITERS and {r["live_replicas"] for r in back} == {2}
    ours = {r["iteration"]: r for r in failure["group0"]}
    for r in back:  # the same global numbers in both groups, bit for bit
        assert (r["loss"], r["grad_norm"]) == (ours[r["iteration"]]["loss"], ours[r["iteration"]]["grad_norm"]), r


def test_both_groups_end_with_bit_identical_weights(failure):
    root = failure["root"]
    states = []
    for name in ("group0", "group1"):
        dcp_to_torch_save(root / name / f"iter_{ITERS:07d}", root / f"{name}.pt")
        states.append(torch.load(root / f"{name}.pt", weights_only=False))
    kept = [{k: v for k, v in s.items() if torch.is_tensor(v)} for s in states]  # weights, optimizer, RNG states
    assert kept[0].keys() == kept[1].keys() and {k.split(".")[0] for k in kept[0]} >= {"optim", "rng"}
    differ = [k for k in kept[0] if not torch.equal(kept[0][k], kept[1][k])]
    assert not differ, differ
    meta = [json.loads((root / name / f"iter_{ITERS:07d}" / "meta.json").read_text()) for name in ("group0", "group1")]
    assert meta[0]["consumed_samples"] == meta[1]["consumed_samples"]


class FakeManager:
    """torchft's manager as ReplicaGroups uses it: ``live`` groups, each all-reduce adding ``others`` times the
    tensor (the live peers holding the same numbers)."""

    def __init__(self, live: int) -> None:
        self.live = live

    def num_participants(self) -> int:
        return self.live

    def allreduce(self, tensor, reduce_op):
        tensor *= self.live

        class Done:
            def wait(self) -> None:
                pass
        return Done()


@pytest.mark.tier("unit")
def test_replica_groups_slots_and_scaling():
    groups = ReplicaGroups(FakeManager(live=1), index=1, count=2)
    assert groups.slot(dp_size=2, dp_rank=1) == (3, 4)
    grads = [torch.ones(3), torch.full((2, 2), 2.0)]
    groups.all_reduce(grads)  # one group live of 2: its sum times 2 / 1
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and torch.equal(grads[1], torch.full((2, 2), 4.0))
    ReplicaGroups(FakeManager(live=2), index=0, count=2).all_reduce(grads)  # both live: the plain sum
    assert torch.equal(grads[0], torch.full((3,), 4.0))
    with pytest.raises(ValueError, match=r"replica group 2 of 2: the index must lie in \[0, 2\)"):
        ReplicaGroups(FakeManager(live=1), index=2, count=2)
