"""``python -m tpzoo.plot``: a PNG of the curves of several runs (opened and checked for size and
colour), its one-line errors, matplotlib missing, and the docs' picture made by the docs' command."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from doc_helpers import ROOT, commands
from tpzoo import plot

pytestmark = pytest.mark.tier("unit")



DOC_PICTURE = ROOT / "docs" / "img" / "curves.png"


def fake_run(folder: Path, scale: float, iterations: int = 30) -> Path:
    """A metrics.jsonl like pretrain.py's: a falling loss, validation every 10, warmup lr; a line cut short."""
    folder.mkdir(parents=True)
    lines = []
    for i in range(1, iterations + 1):
        record = dict(iteration=i, loss=scale * (4 * math.exp(-i / 10) + 2), lr=1e-3 * min(1.0, i / 5),
                      grad_norm=1.0 + 1 / i, skipped=False, loss_scale=1.0, tokens_per_sec=1000.0 * scale + i)
        if i % 10 == 0:
            record["val_loss"] = record["loss"] + 0.1
        lines.append(json.dumps(record))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + '\n{"iteration": 31, "lo')  # killed mid-line
    return folder


def distinct_colours(path: Path) -> int:
    from matplotlib.image import imread

    pixels = imread(str(path))[..., :3]
    return len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0))


def test_plot_draws_every_run_into_a_png(tmp_path, capsys):
    a, b = fake_run(tmp_path / "gpt-a", 1.0), fake_run(tmp_path / "gpt-b", 1.2)
    out = tmp_path / "curves.png"
    plot.main([str(a), str(b / "metrics.jsonl"), "-o", str(out)])
    assert "gpt-a (30 lines), gpt-b (30 lines)" in capsys.readouterr().out
    from matplotlib.image import imread

    assert imread(str(out)).shape[:2] == (650, 1000)
    assert distinct_colours(out) > 100, "a blank picture"
    records = plot.read_records(a / "metrics.jsonl")
    assert len(records) == 30 and plot.series(records, "val_loss")[0] == [10, 20, 30]


def test_plot_adds_the_expert_load_of_a_mixture_of_experts(tmp_path):
    """A run whose lines hold ``tokens_per_expert`` (2 layers of 4 experts) adds the imbalance curve and the last
    line's shares: a taller picture; the imbalance is the mean over layers of the busiest expert over the mean."""
    run = fake_run(tmp_path / "mixtral", 1.0, iterations=4)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:4]]
    for i, record in enumerate(lines):
        record["tokens_per_expert"] = [[64, 64, 64, 64], [100 - i, 60, 50, 46 + i]]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "moe.png"
    plot.main([str(run), str(fake_run(tmp_path / "gpt", 1.0)), "-o", str(out)])
    from matplotlib.image import imread

    assert imread(str(out)).shape[:2] == (950, 1000)
    iterations, values = plot.imbalance(plot.read_records(run / "metrics.jsonl"))
    assert iterations == [1, 2, 3, 4] and values[0] == pytest.approx((1.0 + 100 / 64) / 2)


@pytest.mark.parametrize("case", ["no-metrics", "missing-folder", "unwritable-output", "not-png", "no-matplotlib"])
def test_plot_errors_are_one_line(tmp_path, capsys, monkeypatch, case):
    run = fake_run(tmp_path / "run", 1.0)
    (tmp_path / "empty").mkdir()
    argv, fragment = {"no-metrics": ([str(tmp_path / "empty"), "-o", str(tmp_path / "c.png")],
                                     "holds no metrics.jsonl"),
                      "missing-folder": ([str(tmp_path / "nowhere"), "-o", str(tmp_path / "c.png")], "does not exist"),
                      "unwritable-output": ([str(run), "-o", str(tmp_path / "no" / "c.png")], "cannot be written"),
                      "not-png": ([str(run), "-o", str(tmp_path / "c.jpg")], "PNG"),
                      "no-matplotlib": ([str(run), "-o", str(tmp_path / "c.png")],
                                        "needs the matplotlib package, which is not installed: pip install "
                                        "'tpzoo[monitor]'")}[case]
    if case == "no-matplotlib":
        monkeypatch.setattr(sys, "meta_path", [Blocked("matplotlib"), *sys.meta_path])
        for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:  # imported by another test
            monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SystemExit) as stop:
        plot.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and fragment in err and err.count("\n") == 1, err
    assert not (tmp_path / "c.png").exists()


class Blocked:
    """A meta-path finder that makes importing (or finding) ``name`` fail, as if it were not installed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            raise ModuleNotFoundError(f"No module named {fullname!r}")
        return None


def test_the_docs_picture_is_the_docs_command():
    """docs/training.md shows the plot command (run on the docs' runs by test_training_docs) and its PNG."""
    (command,) = [c for c in commands("training.md") if "tpzoo.plot" in c]
    assert command.endswith("-o curves.png") and "img/curves.png" in (ROOT / "docs" / "training.md"
                                                                      ).read_text().split(command)[1]
    from matplotlib.image import imread

    assert imread(str(DOC_PICTURE)).shape[:2] == (650, 1000) and distinct_colours(DOC_PICTURE) > 100
    assert DOC_PICTURE.stat().st_size < 150_000
