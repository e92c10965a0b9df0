"""Launches that a test kills and starts again (docs/elastic.md's tests): a torchrun agent and its workers as one
"machine" (``Agent``), its metrics.jsonl lines (``records``), and waiting on them (``wait_until``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import background
from doc_helpers import clean_env


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class Agent:
    """A torchrun agent of the job, its output in ``root/<name>.log``."""

    def __init__(self, root: Path, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.log = root / f"{name}.log"
        env = {**clean_env(1), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(background.niced(cmd), cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL to the agent and its workers at once: a machine lost."""
        for pid in descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def records(save: Path) -> list[dict]:
    """Every line of metrics.jsonl, each start's after the one before (a retrained iteration twice)."""
    path = save / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_until(condition, what: str, agents: list[Agent], timeout: float = 240) -> float:
    """Seconds until ``condition()``; fails naming ``what`` with the agents' output after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout or all(a.proc.poll() is not None for a in agents):
            tails = "\n".join(f"--- {a.log.name}\n{a.text()[-3000:]}" for a in agents)
            raise AssertionError(f"waited {timeout:.0f} s for {what}:\n{tails}")
        time.sleep(0.2)
    return time.monotonic() - start
