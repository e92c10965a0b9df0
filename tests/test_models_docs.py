"""Every command and Python block of docs/models.md and docs/conversion.md runs as shown."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpzoo.models import format_presets

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["models.md", "conversion.md"]


def blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "docs" / doc).read_text(), re.S)


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "2"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def check_bench(out: str) -> None:
    """Three models, one line each, starting from the same loss (same shape, same weights)."""
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["tpzoo"], ["hf"],
                                                                                              ["plain"])}
    assert set(rows) == {"tpzoo", "hf", "plain"}, out
    losses = [float(r[-1]) for r in rows.values()]
    assert max(losses) - min(losses) <= 1e-4 * max(losses), out
    assert re.search(r"\(best time per step, below 1 = tpzoo faster\): tpzoo/hf = \d+\.\d\d, "
                     r"tpzoo/plain = \d+\.\d\d", out), out


@pytest.mark.parametrize("doc", DOCS)
def test_doc_commands_and_python_blocks_run(doc, tmp_path):
    (tmp_path / "bench").symlink_to(ROOT / "bench")
    python_blocks, bash_blocks = blocks(doc, "python"), blocks(doc, "bash")
    assert python_blocks and bash_blocks, f"{doc}: no examples found"
    for code in python_blocks:
        done = run([sys.executable, "-c", code], tmp_path)
        assert done.returncode == 0, f"{doc} python block failed:\n{code}\n{done.stderr[-3000:]}"
    for command in (line for block in bash_blocks for line in block.splitlines() if line.strip()):
        done = run(["bash", "-c", command], tmp_path)
        assert done.returncode == 0, f"{doc}: `{command}` failed:\n{done.stderr[-3000:]}"
        if command == "python -m tpzoo.models":
            assert done.stdout.strip() == format_presets()
        if "bench/models.py" in command:
            check_bench(done.stdout)
    if doc == "conversion.md":
        assert (tmp_path / "gpt2-hf-again" / "model.safetensors").is_file()
