"""Run the examples of the docs: the code blocks of a Markdown file, and each shell command in a
clean environment (no torchrun variables, this venv's python and torchrun first on PATH)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def blocks(path: str | Path, lang: str) -> list[str]:
    """The ```lang fenced blocks of the Markdown file ``path`` (relative to docs/ unless absolute)."""
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "docs" / path).read_text(), re.S)


def commands(path: str | Path) -> list[str]:
    """Every non-empty line of the bash blocks of ``path``."""
    return [line for block in blocks(path, "bash") for line in block.splitlines() if line.strip()]


def clean_env(threads: int = 2) -> dict[str, str]:
    """os.environ without torchrun's variables, this venv first on PATH, ``threads`` OpenMP threads
    per process."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": str(threads)}
    return {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}


def run(command: list[str], cwd: Path, timeout: float = 300, threads: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=clean_env(threads), timeout=timeout)
