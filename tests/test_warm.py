"""Warm starts (tests/warm.py) on commands of their own: a server that preloads nothing heavy, and scripts named
like the commands it takes. The command runs in the server's child as in a fresh process (its argv, folder,
environment and exit code; ``sys.orig_argv`` tells the child from a fresh interpreter), a signal reaches it, a
stopped client stops it, a killed client takes it down, and what the server cannot run as a fresh interpreter would starts fresh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm

pytestmark = pytest.mark.tier("journey")

SCRIPT = """
import os, signal, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PROBE"), "warm", "warm.py" in " ".join(sys.orig_argv),
      flush=True)
signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), sys.exit(0)))
if "--sleep" in sys.argv:
    print("pid", os.getpid(), flush=True)
    time.sleep(60)
sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 0)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> tuple[dict[str, str], Path]:
    folder = tmp_path_factory.mktemp("warm")
    (folder / "pretrain.py").write_text(SCRIPT)
    (folder / "other.py").write_text(SCRIPT)
    env = {**os.environ, "PROBE": "seen"}
    env.pop("TPZOO_WARM", None)
    proc = warm.start(env, preload=("json",))
    deadline = time.monotonic() + 60
    while not os.path.exists(env["TPZOO_WARM_SOCKET"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield env, folder
    proc.kill()


def run(env: dict[str, str], folder: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=folder, env=env, capture_output=True, text=True, timeout=60)


def test_a_command_runs_warm_as_it_would_fresh(server):
    env, folder = server
    done = run(env, folder, "pretrain.py", "--flag", "3")
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith(f"argv ['--flag', '3'] cwd {folder} env seen warm True"), done.stdout
    cold = run(env, folder, "other.py", "--flag", "3")  # not a command the server takes
    assert cold.returncode == 3 and cold.stdout.startswith(f"argv ['--flag', '3'] cwd {folder} env seen warm False")
    other_python = run({**env, "TORCH_LOGS": "+dynamo"}, folder, "pretrain.py")  # read as torch loads: fresh
    assert other_python.returncode == 0 and "warm False" in other_python.stdout, other_python.stdout


def wait_for(condition, what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def state(pid: int) -> str:
    return warm._state(pid) or "gone"


def test_signals_reach_the_command_a_stop_stops_it_and_a_killed_client_takes_it_down(server):
    env, folder = server
    for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen([sys.executable, "pretrain.py", "--sleep"], cwd=folder, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = proc.stdout.readline()
        assert "warm True" in first, first + proc.stderr.read()
        child = int(proc.stdout.readline().split()[1])
        assert child != proc.pid
        proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            wait_for(lambda: state(child) == "T", f"the command {child} runs on while its client is stopped")
            proc.send_signal(signal.SIGCONT)
            wait_for(lambda: state(child) in ("S", "R"), f"the command {child} stays stopped")
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        if sig == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
        else:
            assert proc.returncode == 0 and out.strip() == "terminated", (proc.returncode, out)
        wait_for(lambda: state(child) in ("Z", "gone"), f"the command {child} outlived its client")
