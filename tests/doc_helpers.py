"""Run the examples of the docs: the code blocks of a Markdown file, and each shell command in a
clean environment (no torchrun variables, this venv's python and torchrun first on PATH)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import background

ROOT = Path(__file__).resolve().parents[1]


def split_section(text: str, heading: str) -> tuple[str, str]:
    """(the section of Markdown ``text`` that starts with the line ``heading``, up to the next heading of its
    level or above; the text without it)."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(f"\n{heading}\n") + 1
    end = re.search(rf"^#{{1,{level}}} ", text[start + len(heading):], re.M)
    stop = start + len(heading) + end.start() if end else len(text)
    return text[start:stop], text[:start] + text[stop:]


def blocks(path: str | Path, lang: str, section: str | None = None, skip: str | None = None) -> list[str]:
    """The ```lang fenced blocks of the Markdown file ``path`` (relative to docs/ unless absolute); with
    ``section`` (a heading line) those of that section only, with ``skip`` those outside it."""
    text = (ROOT / "docs" / path).read_text()
    if section or skip:
        inside, outside = split_section(text, section or skip)
        text = inside if section else outside
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(path: str | Path) -> list[str]:
    """Every non-empty line of the bash blocks of ``path``."""
    return [line for block in blocks(path, "bash") for line in block.splitlines() if line.strip()]


def clean_env(threads: int = 2) -> dict[str, str]:
    """os.environ (in a background job: the session's, ``background.environ``) without torchrun's variables,
    this venv first on PATH, ``threads`` OpenMP threads per process."""
    env = background.environ()
    env = {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "OMP_NUM_THREADS": str(threads)}
    return {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}


def run(command: list[str], cwd: Path, timeout: float = 300, threads: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(background.niced(command), capture_output=True, text=True, cwd=cwd, env=clean_env(threads),
                          timeout=timeout)


def writes(command: str) -> set[str]:
    """The paths a shell command of the docs writes: DIR of ``--save DIR`` and ``--export DIR``, the output
    folder (last argument) of ``python -m tpzoo.convert``, and PREFIX.model of ``--model-prefix PREFIX``."""
    words = shlex.split(command)
    made = {word for flag, word in zip(words, words[1:]) if flag in ("--save", "--export")}
    made |= {f"{word}.model" for flag, word in zip(words, words[1:]) if flag == "--model-prefix"}
    return made | ({words[-1]} if "tpzoo.convert" in words else set())


def needs(later: str, earlier: str) -> bool:
    """Whether shell command ``later`` must wait for ``earlier``: one writes a folder (``writes``) that
    the other names, as a word or inside one (``runs/3d`` names ``runs/3d/iter_0000010``, and ``runs``)."""
    def related(made: set[str], words: list[str]) -> bool:
        return any(w == m or w.startswith(m + "/") or m.startswith(w + "/") for m in made for w in words)
    return related(writes(earlier), shlex.split(later)) or related(writes(later), shlex.split(earlier))


def stop(running: dict[int, tuple[subprocess.Popen, IO[str], IO[str]]]) -> None:
    """SIGKILL the process group of every running command and reap it."""
    for proc, *_ in running.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_as_needed(commands: list[str], cwd: Path, slots: int = 2, timeout: float = 600,
                  check: bool = True) -> list[subprocess.CompletedProcess]:
    """Run the shell ``commands`` of a doc in ``cwd``, each once every earlier command it ``needs`` has
    finished; up to ``slots`` at once, each on one OpenMP thread (the docs' tiny models run about as
    fast on one thread as on two, so on 2 cores two independent commands take half the time). With
    ``check``, the first command that fails fails the call with its stderr (the others are killed).
    Returns each command's result (its output as text), in the order of ``commands``. In a background job
    (tests/background.py) the commands run niced."""
    after = [{j for j in range(i) if needs(commands[i], commands[j])} for i in range(len(commands))]
    done: dict[int, subprocess.CompletedProcess] = {}
    running: dict[int, tuple[subprocess.Popen, IO[str], IO[str]]] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(commands):
        for i, command in enumerate(commands):
            if len(running) < slots and i not in done and i not in running and after[i] <= done.keys():
                out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                proc = subprocess.Popen(background.niced(["bash", "-c", command]), cwd=cwd, env=clean_env(1),
                                        stdout=out, stderr=err,
                                        start_new_session=True)  # a process group: stop() ends torchrun's ranks too
                running[i] = (proc, out, err)
        for i, (proc, out, err) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[i]
            out.seek(0), err.seek(0)
            done[i] = subprocess.CompletedProcess(commands[i], proc.returncode, out.read(), err.read())
            out.close(), err.close()
            if check and proc.returncode != 0:
                stop(running)
                raise AssertionError(f"`{commands[i]}` failed (status {proc.returncode}):\n{done[i].stderr[-3000:]}")
        if time.monotonic() > deadline:
            stop(running)
            raise AssertionError(f"still running after {timeout} s: {[commands[i] for i in running]}")
        time.sleep(0.05)
    return [done[i] for i in range(len(commands))]
