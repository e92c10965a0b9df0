"""Megatron-LM's logging flags: one pretrain.py run with TensorBoard, W&B (offline), the params norm, zeros in
the gradients, throughput and every timer, read back from metrics.jsonl, the TensorBoard events and the W&B run
folder; the counting of the norm and the zeros over a tp x pp x dp mesh, the timers, the writers' filter and
interval as unit tests; a flag whose library is missing stops in one line."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import background
from pretrain_helpers import PRETRAIN, TINY, env, metrics
from test_plot import Blocked
from tpzoo.engine import grads
from tpzoo.engine.timers import LEVELS, Timers
from tpzoo.parallel import mark
from tpzoo.training.metrics import Metrics
from tpzoo.training.logging_args import LoggingConfig
from tpzoo.training.monitor import INSTALL, shown, tensorboard_writers

pytestmark = pytest.mark.tier("journey")



FLAGS = [*TINY, "--train-iters", "4", "--log-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
         "--save", "ck", "--tensorboard-dir", "tb", "--tensorboard-log-interval", "1", "--wandb-project", "tpzoo-test",
         "--wandb-exp-name", "tiny-run", "--log-params-norm", "--log-num-zeros-in-grad", "--log-throughput",
         "--timing-log-level", "2", "--timing-log-option", "all", "--log-timers-to-tensorboard",
         "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
         "--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
         "--tensorboard-queue-size", "5",
         "--log-batch-size-to-tensorboard", "--wandb-save-dir", "wb", "--wandb-entity", "tpzoo-team"]


def wandb_env(root: Path) -> dict[str, str]:
    """Offline W&B whose own folders (config, cache) stay in ``root``."""
    return {**env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(root / "wandb-config"),
            "WANDB_CACHE_DIR": str(root / "wandb-cache"), "WANDB_DATA_DIR": str(root / "wandb-data")}


@background.fixture
def logged(tmp_path_factory) -> Path:
    """The folder of one tiny pretrain.py run with every logging flag."""
    root = tmp_path_factory.mktemp("monitor")
    done = subprocess.run(background.niced([sys.executable, PRETRAIN, *FLAGS]), capture_output=True, text=True,
                          cwd=root, env=wandb_env(root), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    (root / "stdout.txt").write_text(done.stdout)
    return root


def test_logging_flags_fill_metrics_jsonl(logged):
    log = metrics(logged / "ck")
    assert sorted(log) == [2, 4], "--tensorboard-log-interval adds no metrics.jsonl line"
    for record in log.values():
        assert record["world_size"] == 1 and record["mem_max_rss_bytes"] > 1e6
        assert record["val_ppl"] == pytest.approx(math.exp(record["val_loss"]))
        assert {f"time/{name}" for name in LEVELS} | {f"time/{name}/rank0" for name in LEVELS} <= set(record)
        assert record["time/iteration"] >= record["time/forward-backward"] > 0
        assert 0 < record["num_zeros"] < 20_000 and isinstance(record["num_zeros"], int)
    assert "throughput" in (logged / "stdout.txt").read_text()


def test_throughput_is_model_tflops_per_gpu(logged):
    from tpzoo.checkpoint import read_meta
    from tpzoo.models.families import config_from_dict
    from tpzoo.training.metrics import flops_per_token

    record = metrics(logged / "ck")[4]
    config = config_from_dict(read_meta(logged / "ck" / "iter_0000004")["model_config"])
    expected = record["tokens_per_sec"] * flops_per_token(config, 16) / 1e12
    assert record["throughput"] == pytest.approx(expected, rel=1e-9)


def test_params_norm_is_the_norm_of_the_saved_weights(logged):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(logged / "ck" / "iter_0000004", logged / "full.pt")
    state = torch.load(logged / "full.pt", weights_only=False)
    weights = torch.cat([v.flatten().float() for k, v in state.items() if k.startswith("model.")])
    norm = torch.linalg.vector_norm(weights).item()
    assert metrics(logged / "ck")[4]["params_norm"] == pytest.approx(norm, rel=1e-5)
    assert metrics(logged / "ck")[2]["params_norm"] != metrics(logged / "ck")[4]["params_norm"]


def test_tensorboard_events_in_tensorboard_dir(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/params_norm", "train/num_zeros", "train/throughput", "time/optimizer", "time/batch/min",
            "valid/loss", "valid/ppl", "train/world_size", "train/global_batch_size"} <= tags
    assert "train/loss_scale" not in tags, "--no-log-loss-scale-to-tensorboard"
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4], "--tensorboard-log-interval 1"
    assert [e.value for e in events.Scalars("train/params_norm")][-1] == pytest.approx(
        metrics(logged / "ck")[4]["params_norm"])
    assert not list((logged / "ck").glob("events.out.tfevents*")), "events go to --tensorboard-dir only"


def test_wandb_offline_run_folder(logged):
    (run,) = (logged / "wb" / "wandb").glob("offline-run-*/run-*.wandb")  # --wandb-save-dir wb
    data = run.read_bytes()
    for text in (b"tiny-run", b"tpzoo-test", b"tpzoo-team", b"train/params_norm", b"time/forward-backward",
                 b"valid/ppl"):
        assert text in data, text


@pytest.mark.tier("unit")
def test_metrics_writers_get_shown_fields_every_board_interval(tmp_path):
    class Recorder:
        def __init__(self) -> None:
            self.scalars: dict[str, list[int]] = {}

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.setdefault(tag, []).append(step)

        def close(self) -> None:
            pass

    writer = Recorder()
    flags = LoggingConfig(log_loss_scale_to_tensorboard=False, log_timers_to_tensorboard=False)
    m = Metrics(tmp_path, train_iters=4, log_interval=2, interactive=False, writers=[writer], throughput=True,
                flops_per_token=3e12, world_size=2, shown=shown(flags), board_interval=1)
    for i in range(1, 5):
        m.step(tokens=100, seconds=0.5)
        record = m.log(i, loss=1.0, lr=1e-3, grad_norm=1.0, stats={"params_norm": 2.0, "time/optimizer": 0.1})
    m.close()
    assert record["throughput"] == pytest.approx(200 * 3e12 / 2 / 1e12), "tokens/s x FLOPs per token / GPUs"
    assert writer.scalars["train/params_norm"] == [1, 2, 3, 4] and "time/optimizer" not in writer.scalars
    assert "train/loss_scale" not in writer.scalars and "train/throughput" not in writer.scalars
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.tier("unit")
def test_timers_by_level_and_option(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr("tpzoo.engine.timers.time.perf_counter", lambda: float(next(clock)))
    assert Timers().collect(1) == {} and Timers(0).names == ["iteration"]
    assert "batch" not in Timers(1).names and "batch" in Timers(2).names
    timers = Timers(1)
    timers.start("batch")  # level 2: not timed at level 1
    timers.stop("batch")
    for _ in range(2):
        timers.start("optimizer")
        timers.stop("optimizer")  # 1 s each
    assert timers.collect(4, "all") == {**{f"time/{n}{s}": 0.0 for n in timers.names for s in ("", "/min", "/rank0")
                                           if n != "optimizer"},
                                        "time/optimizer": 0.5, "time/optimizer/min": 0.5, "time/optimizer/rank0": 0.5}
    assert timers.collect(1, "max")["time/optimizer"] == 0.0, "collect starts the next window"
    with pytest.raises(KeyError, match="unknown timer"):
        timers.start("forward")
    with pytest.raises(ValueError, match="timing level"):
        Timers(3)


def rank_params(tp_rank: int, pp_rank: int, dp_rank: int, sharded: bool) -> list[nn.Parameter]:
    """One rank of a tp 2 x pp 2 x dp 2 model: a tp shard, a tp replica, the pp-tied embedding (a tp shard);
    ``sharded``: each dp rank holds half of every weight (ZeRO's owners, FSDP); else dp replicas."""
    def param(values: list[float], **facts) -> nn.Parameter:
        values = values[dp_rank::2] if sharded else values
        p = nn.Parameter(torch.tensor(values))
        p.grad = torch.tensor([0.0 if v > 4 else v for v in values])  # zeros where the weight is over 4
        return mark(p, **facts)

    shard = param([1.0 + tp_rank + 2 * pp_rank, 5.0, 2.0, 7.0], tp_split_dim=0)
    replica = param([3.0 + pp_rank, 6.0])
    tied = param([5.0 + tp_rank, 1.0], tp_split_dim=0, pp_tied=True)
    return [shard, replica, tied]


def full_model() -> list[float]:
    """Every distinct weight once: the shards of each (tp, pp), each stage's replica once, the tied embedding once."""
    return ([x for pp in range(2) for tp in range(2) for x in (1.0 + tp + 2 * pp, 5.0, 2.0, 7.0)]
            + [x for pp in range(2) for x in (3.0 + pp, 6.0)] + [x for tp in range(2) for x in (5.0 + tp, 1.0)])


@pytest.mark.tier("unit")
@pytest.mark.parametrize("sharded", [False, True], ids=["dp-replicas", "dp-shards"])
def test_params_norm_and_zeros_count_each_element_once(monkeypatch, sharded):
    """Each rank's local part as the functions count it, summed over every rank as their all-reduce over tp, pp
    (and dp when sharded) sums it: the full model's norm and zeros, each element once."""
    monkeypatch.setattr(grads.dist, "get_world_size", lambda group=None: 1)  # the sums below stand in for it
    squares = zeros = 0.0
    for tp in range(2):
        for pp in range(2):
            for dp in range(2) if sharded else range(1):  # dp replicas are not summed over dp
                mesh = SimpleNamespace(tp_rank=tp, pp_rank=pp, dp_rank=dp, device=torch.device("cpu"), tp_group=None,
                                       pp_group=None, dp_group=None, dp_cp_group=None, fsdp_group=None, ep_size=1)
                params = rank_params(tp, pp, dp, sharded)
                squares += grads.global_params_norm(params, mesh, sharded).item() ** 2
                zeros += grads.count_zero_grads(params, mesh, sharded).item()
    full = torch.tensor(full_model())
    assert math.sqrt(squares) == pytest.approx(torch.linalg.vector_norm(full).item(), rel=1e-6)
    assert zeros == (full > 4).sum().item()


# a sitecustomize.py that makes importing {blocked} fail in a subprocess, as if it were not installed
BLOCK = '''import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Blocked())
'''


@pytest.mark.tier("unit")
def test_without_tensorboard_the_log_dir_gets_no_events_and_nothing_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "meta_path", [Blocked("tensorboard"), *sys.meta_path])
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboard"]:  # imported by another test
        monkeypatch.delitem(sys.modules, name)
    m = Metrics(tmp_path, train_iters=1, log_interval=1, interactive=False, writers=tensorboard_writers(tmp_path))
    m.log(1, loss=1.0, lr=1e-3, grad_norm=1.0)
    m.close()
    assert m.writers == [] and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flag,module", [("--wandb-project", "wandb"), ("--tensorboard-dir", "tensorboard")])
def test_flag_without_its_library_is_one_line(tmp_path, flag, module):
    """A sitecustomize on PYTHONPATH makes ``module`` impossible to import, as if it were not installed."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK.format(blocked=(module,)))
    done = subprocess.run([sys.executable, PRETRAIN, *TINY, flag, "x"], capture_output=True, text=True,
                          cwd=tmp_path, env={**env(), "PYTHONPATH": str(tmp_path)}, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"{flag} needs the {module} package, which is not installed: {INSTALL}" in done.stderr
    assert not (tmp_path / "x").exists()
