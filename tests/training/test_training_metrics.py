"""``Metrics`` on an interactive terminal (a tqdm bar) and in plain mode: the same metrics.jsonl, lines
above the bar, a resumed log that drops what came after the loaded iteration."""

from __future__ import annotations

import json

import pytest

from tpzoo.training.metrics import Metrics

pytestmark = pytest.mark.tier("unit")




def run_log(log_dir, interactive: bool, start: int = 0, stop: int = 6) -> None:
    metrics = Metrics(log_dir, train_iters=6, log_interval=2, start=start, interactive=interactive, writers=[])
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


class Recorder:
    """A stand-in for TensorBoard's SummaryWriter: the (tag, value, step) of every scalar."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        pass


def test_loss_parts_go_to_metrics_jsonl_and_tensorboard(tmp_path):
    writer = Recorder()
    metrics = Metrics(tmp_path, train_iters=2, log_interval=1, interactive=False, writers=[writer])
    metrics.log(1, loss=5.5, losses={"mlm_loss": 4.8, "sop_loss": 0.7}, lr=1e-3, grad_norm=1.0)
    metrics.log(2, loss=5.4, losses={"mlm_loss": 4.7, "sop_loss": 0.7}, lr=1e-3, grad_norm=1.0, val_loss=5.6,
                val_losses={"mlm_loss": 4.9, "sop_loss": 0.7}, last=True)
    metrics.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["mlm_loss"] == 4.8 and "val_mlm_loss" not in lines[0]
    assert (lines[1]["val_loss"], lines[1]["val_mlm_loss"], lines[1]["val_sop_loss"]) == (5.6, 4.9, 0.7)
    tags = {tag: value for tag, value, step in writer.scalars if step == 2}
    assert (tags["train/mlm_loss"], tags["train/sop_loss"], tags["valid/loss"], tags["valid/mlm_loss"]) == \
        (4.7, 0.7, 5.6, 4.9)


def test_expert_load_goes_to_metrics_jsonl_as_a_table_and_to_tensorboard_cell_by_cell(tmp_path, capsys):
    writer = Recorder()
    metrics = Metrics(tmp_path, train_iters=1, log_interval=1, interactive=False, writers=[writer])
    metrics.log(1, loss=5.5, lr=1e-3, grad_norm=1.0, stats={"tokens_per_expert": [[3, 1], [2, 2]]}, last=True)
    metrics.close()
    (line,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["tokens_per_expert"] == [[3, 1], [2, 2]]
    tags = {tag: value for tag, value, _ in writer.scalars}
    assert [tags[f"tokens_per_expert/layer{i}/expert{e}"] for i in (0, 1) for e in (0, 1)] == [3, 1, 2, 2]
    assert "tokens_per_expert" not in capsys.readouterr().out  # the printed line leaves the table out


def test_flops_per_token_count_the_parameters_a_token_goes_through():
    """A mixture of experts' token goes through k of its N experts: Mixtral-8x7B's 2 of 8 leave 12,879,925,248 of
    its 46,702,792,704 parameters (the 12.9B "active" its card gives)."""
    from tpzoo.models import get_preset, num_parameters
    from tpzoo.training.metrics import active_parameters, flops_per_token

    mixtral, dense = get_preset("mixtral-8x7b"), get_preset("mistral-7b")
    assert (num_parameters(mixtral), active_parameters(mixtral)) == (46_702_792_704, 12_879_925_248)
    assert active_parameters(dense) == num_parameters(dense)
    assert flops_per_token(mixtral, 4096) == 6 * 12_879_925_248 + 12 * 32 * 4096 * 4096
