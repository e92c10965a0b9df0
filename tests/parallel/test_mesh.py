"""The mesh as a lone process and under torchrun, its misuse errors, and the test harness itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tpzoo.parallel import init_mesh, mesh_shape
from tpzoo.testing import DistributedTestError, spawn

pytestmark = pytest.mark.tier("journey")



ROOT = Path(__file__).resolve().parents[2]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1"}


def run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd=ROOT)


def doc_commands(doc: str, heading: str) -> list[str]:
    """The command lines of the bash block under ``## heading`` (or ``### heading``) of a doc."""
    section = (ROOT / doc).read_text().split(f"# {heading}\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def as_argv(command: str) -> list[str]:
    """A documented command with `python`/`torchrun` bound to this interpreter."""
    argv = command.split()
    head = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}[argv[0]]
    return head + argv[1:]


def test_lone_process_mesh():
    """No torchrun, no environment: init_mesh starts a one-rank gloo group."""
    probe = run([sys.executable, "-c", "from tpzoo.parallel import init_mesh; m = init_mesh(); "
                 "import torch.distributed as d; print(m.pp_size, m.dp_size, m.tp_size, d.get_backend(), m.device)"])
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["1", "1", "1", "gloo", "cpu"]


def test_parallelism_guide_example_commands():
    """docs/parallelism.md's example, as one process and under torchrun at tp=2, matches dense PyTorch."""
    commands = doc_commands("docs/parallelism.md", "An example: a tensor-parallel MLP")
    assert len(commands) == 2 and any(c.startswith("torchrun") for c in commands)
    for command in commands:
        proc = run(as_argv(command), timeout=90)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
        tp = command.split("--tp ")[1] if "--tp" in command else "1"
        assert f"tp={tp}: input-gradient relative error" in proc.stdout, proc.stdout


@pytest.mark.tier("unit")
@pytest.mark.parametrize("kwargs, exc, message", [
    ({"tp": 0}, ValueError, "tp must be >= 1, got tp=0"),
    ({"pp": -2}, ValueError, "pp must be >= 1, got pp=-2"),
    ({"dp": 0}, ValueError, "dp must be >= 1, got dp=0"),
    ({"ep": 0}, ValueError, "ep must be >= 1, got ep=0"),
    ({"ep": 2}, ValueError, "expert parallelism ep=2 must divide the data-parallel size dp=1"),
    ({"tp": "2"}, TypeError, "tp must be an int, got str '2'"),
    ({"tp": 2.0}, TypeError, "tp must be an int, got float 2.0"),
])
def test_init_mesh_rejects_bad_sizes_before_starting_anything(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        init_mesh(**kwargs)
    assert not dist.is_initialized()


@pytest.mark.tier("unit")
def test_mesh_shape_infers_dp_and_names_the_numbers():
    assert mesh_shape(8, tp=2, pp=2) == (2, 2, 2)
    assert mesh_shape(8, tp=8) == (1, 1, 8)
    assert mesh_shape(8, pp=4, dp=2) == (4, 2, 1)
    with pytest.raises(ValueError, match="world size 8 is not divisible by tp x pp = 3 x 1 = 3"):
        mesh_shape(8, tp=3)
    with pytest.raises(ValueError, match=r"tp x pp x dp = 2 x 2 x 1 = 4 does not equal the world size 8"):
        mesh_shape(8, tp=2, pp=2, dp=1)


def raise_on_rank_one() -> None:
    if int(os.environ["RANK"]) == 1:
        raise KeyError("boom on purpose")


def exit_without_word() -> None:
    if int(os.environ["RANK"]) == 1:
        os._exit(3)


def sleep_forever() -> None:
    time.sleep(600)


def peer_hangs_in_collective() -> None:
    init_mesh(timeout=timedelta(seconds=3))
    if dist.get_rank() == 1:
        time.sleep(60)  # never joins the all-reduce below
    dist.all_reduce(torch.ones(1))


@pytest.mark.tier("distributed")
def test_harness_surfaces_failures_and_never_hangs():
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 of 2 failed:.*KeyError: 'boom on purpose'"):
        spawn(raise_on_rank_one, 2)
    with pytest.raises(DistributedTestError, match="rank 1 exited with code 3 without reporting"):
        spawn(exit_without_word, 2)
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"timed out after 5s; ranks \[0, 1\] never finished"):
        spawn(sleep_forever, 2, timeout=5)
    assert time.monotonic() - start < 30


@pytest.mark.tier("distributed")
def test_process_group_timeout_turns_a_hang_into_an_error():
    """A peer that never joins a collective: rank 0 fails after the mesh's 3 s timeout, no hang."""
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?is)rank 0 of 2 failed:.*time"):
        spawn(peer_hangs_in_collective, 2, timeout=50)
    assert time.monotonic() - start < 40
