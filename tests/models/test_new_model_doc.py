"""docs/new-model.md: its Python blocks, saved as my_model.py, train a new model built from the public
blocks at tp 2 x pp 2 x dp 2 with the command the page shows, and the loss falls."""

from __future__ import annotations

import re

from doc_helpers import blocks, commands, run


def test_new_model_tutorial_trains_at_tp2_pp2_dp2(tmp_path):
    (tmp_path / "my_model.py").write_text("\n".join(blocks("new-model.md", "python")))
    assert commands("new-model.md") == ["torchrun --nproc-per-node 8 my_model.py"]
    done = run(commands("new-model.md")[0].split(), tmp_path, timeout=600, threads=1)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) over 30 steps at tp 2 x pp 2 x dp 2", done.stdout)
    assert found, done.stdout
    first, last = map(float, found.groups())
    assert last < first - 0.5, f"the loss did not fall: {first} -> {last}"
