"""``Metrics`` on an interactive terminal (a tqdm bar) and in plain mode: the same metrics.jsonl, lines
above the bar, a resumed log that drops what came after the loaded iteration."""

from __future__ import annotations

import json

import pytest

from tpzoo.training.metrics import Metrics


def run_log(log_dir, interactive: bool, start: int = 0, stop: int = 6) -> None:
    metrics = Metrics(log_dir, train_iters=6, log_interval=2, start=start, interactive=interactive)
    metrics.print("resumed" if start else "starting")
    for i in range(start + 1, stop + 1):
        metrics.step(tokens=128, seconds=0.5)
        metrics.log(i, loss=10.0 / i, lr=1e-3, grad_norm=1.0, val_loss=5.0 if i == 4 else None, last=i == 6)
    metrics.close()


@pytest.mark.parametrize("interactive", [True, False])
def test_bar_and_plain_lines_write_the_same_metrics(tmp_path, capsys, interactive):
    run_log(tmp_path, interactive)
    out = capsys.readouterr()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [2, 4, 6]
    assert lines[1]["val_loss"] == 5.0 and lines[0]["tokens_per_sec"] == pytest.approx(256.0)
    assert "starting" in out.out
    assert ("it/s" in out.err or "6/6" in out.err) == interactive, out.err  # the bar draws on stderr


def test_resume_drops_lines_after_the_loaded_iteration(tmp_path):
    run_log(tmp_path, False)
    run_log(tmp_path, False, start=2)  # resumed at iteration 2: lines 4 and 6 are written again
    assert [json.loads(line)["iteration"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6]
