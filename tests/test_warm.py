"""Warm starts (tests/warm.py) on commands of their own: a server that preloads nothing heavy, and scripts named
like the commands it takes. The command runs in the server's child as in a fresh process (its argv, folder,
environment, exit code, errors and output; ``sys.orig_argv`` tells the child from a fresh interpreter), a signal
reaches it, a stopped client stops it, a killed client takes it down, and what the server cannot run as a fresh
interpreter would starts fresh."""

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
warm = "warm.py" in " ".join(sys.orig_argv)
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PROBE"), "warm", warm, flush=True)
signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), sys.exit(0)))
if "--sleep" in sys.argv:
    print("pid", os.getpid(), flush=True)
    time.sleep(60)
if "--raise" in sys.argv:
    raise ValueError("boom")
if "--killed" in sys.argv:
    print("said before the end", file=sys.stderr)  # stderr is line-buffered: a fresh process has written it
    os.kill(os.getpid(), signal.SIGKILL)
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
    warm.stop(proc)


def run(env: dict[str, str], folder: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=folder, env=env, capture_output=True, text=True, timeout=60)


def test_a_command_runs_warm_as_it_would_fresh(server):
    env, folder = server
    done = run(env, folder, "pretrain.py", "--flag", "3")
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith(f"argv ['--flag', '3'] cwd {folder} env seen warm True"), done.stdout
    cold = run(env, folder, "other.py", "--flag", "3")  # not a command the server takes
    assert cold.returncode == 3 and cold.stdout.startswith(f"argv ['--flag', '3'] cwd {folder} env seen warm False")
    for changed in ({"TORCH_LOGS": "+dynamo"}, {"TPZOO_WARM": "0"}):  # read as torch loads; asked: fresh
        fresh = run({**env, **changed}, folder, "pretrain.py")
        assert fresh.returncode == 0 and "warm False" in fresh.stdout, (changed, fresh.stdout)


def test_errors_and_deaths_end_the_command_as_they_end_python(server):
    env, folder = server
    raised = run(env, folder, "pretrain.py", "--raise")
    assert "warm True" in raised.stdout and raised.returncode == 1, raised
    assert raised.stderr.rstrip().endswith("ValueError: boom") and "pretrain.py" in raised.stderr, raised.stderr
    killed = run(env, folder, "-u", "pretrain.py", "--killed")
    assert "warm True" in killed.stdout and killed.returncode == -signal.SIGKILL, killed
    assert killed.stderr == "said before the end\n", killed.stderr
    missing = run(env, folder, "finetune.py")  # a command's script that is not there
    assert missing.returncode == 2 and "can't open file" in missing.stderr, missing
    module = run(env, folder, "-m", "tpzoo.data", "--help")
    assert module.returncode == 0 and module.stdout.startswith("usage:"), module


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
