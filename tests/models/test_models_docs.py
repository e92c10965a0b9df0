"""Every command and Python block of docs/models.md and docs/conversion.md runs as shown."""

from __future__ import annotations

import re
import sys

import pytest
from doc_helpers import ROOT, blocks, commands, run

from tpzoo.models import format_presets

DOCS = ["models.md", "conversion.md"]


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
    python_blocks, shell = blocks(doc, "python"), commands(doc)
    assert python_blocks and shell, f"{doc}: no examples found"
    for code in python_blocks:
        done = run([sys.executable, "-c", code], tmp_path)
        assert done.returncode == 0, f"{doc} python block failed:\n{code}\n{done.stderr[-3000:]}"
    for command in shell:
        done = run(["bash", "-c", command], tmp_path)
        assert done.returncode == 0, f"{doc}: `{command}` failed:\n{done.stderr[-3000:]}"
        if command == "python -m tpzoo.models":
            assert done.stdout.strip() == format_presets()
        if "bench/models.py" in command:
            check_bench(done.stdout)
    if doc == "conversion.md":
        assert (tmp_path / "gpt2-hf-again" / "model.safetensors").is_file()
