"""Every command and Python block of docs/models.md and docs/conversion.md runs as shown."""

from __future__ import annotations

import sys

import pytest
from doc_helpers import blocks, commands, run

from tpzoo.models import format_presets

pytestmark = pytest.mark.tier("journey")



DOCS = ["models.md", "conversion.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_doc_commands_and_python_blocks_run(doc, tmp_path):
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
    if doc == "conversion.md":
        assert (tmp_path / "gpt2-hf-again" / "model.safetensors").is_file()
