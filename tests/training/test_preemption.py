"""Preemption and early exits of pretrain.py and finetune.py (``tpzoo.training.stopping``).

One module fixture runs, at once, an uninterrupted single-process run, the same run sent SIGTERM at
a random logged iteration, and a 4-rank torchrun of it whose torchrun is sent SIGTERM (the agent
forwards it to every worker); then both interrupted runs are resumed with ``--load`` into new folders
(one process each: the 4-rank checkpoint on another mesh), one until ``--exit-interval``, the other
until ``--exit-duration-in-mins``, beside a finetune.py run with ``--exit-interval``. The rest are
in-process checks of the signal handler and the flags.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from doc_helpers import ROOT
from pretrain_helpers import PRETRAIN, TINY, command, env, metrics, rel

from tpzoo.training import stopping
from tpzoo.training.stopping import SignalFlag, StopRules

pytestmark = pytest.mark.tier("journey")



ITERS = 30
FLAGS = TINY + f"--train-iters {ITERS} --eval-interval 10 --eval-iters 1".split()
MESH = (2, 1, 2)
EXIT_INTERVAL, EXIT_MINUTES = 20, 0.002  # the resumed runs' early exits (after the SIGTERMs' <= ITERS // 2 + 2)
LOSS_TOL = 1e-5  # another mesh: the same losses up to float rounding (tests/training/test_pretrain.py)
FIELDS = ("loss", "lr", "grad_norm", "val_loss")
# each torchrun worker runs pretrain.py in-process and writes how it ended to status.<RANK> ("0": returned)
STATUS_WRAPPER = """import os, runpy, sys
status = "killed"
try:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    status = "0"
except SystemExit as e:
    status = str(e.code)
    raise
except BaseException as e:
    status = type(e).__name__
    raise
finally:
    with open(f"status.{os.environ['RANK']}", "w") as f:
        f.write(status)
"""


class Launched:
    """A process started with its stdout and stderr in ``cwd/name.out`` and ``cwd/name.err``, saving to
    ``cwd/folder`` (default: ``name``)."""

    def __init__(self, name: str, cmd: list[str], cwd: Path, folder: str | None = None) -> None:
        self.name, self.cwd, self.folder = name, cwd, folder or name
        with open(cwd / f"{name}.out", "w") as out, open(cwd / f"{name}.err", "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=out, stderr=err)
        self.signalled_after: int | None = None   # the last iteration logged when the signal was sent
        self.seconds_to_exit: float | None = None
        self.status: list[str] | None = None        # torchrun: how each worker ended (STATUS_WRAPPER)

    def wait(self, timeout: float = 400) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    @property
    def stdout(self) -> str:
        return (self.cwd / f"{self.name}.out").read_text()

    @property
    def stderr(self) -> str:
        return (self.cwd / f"{self.name}.err").read_text()


def logged(log_dir: Path) -> int:
    """The last iteration in ``log_dir/metrics.jsonl`` (0 before the first)."""
    try:
        return max(metrics(log_dir), default=0)
    except (FileNotFoundError, ValueError):  # not written yet, or a line half written
        return 0


def sigterm_at(runs: dict[Launched, int], timeout: float = 300) -> None:
    """Send SIGTERM to each run once its metrics.jsonl (in ``cwd/name``) logged its iteration, and time
    its exit."""
    sent: dict[Launched, float] = {}
    deadline = time.monotonic() + timeout
    while len(sent) < len(runs) or any(run.proc.poll() is None for run in runs):
        assert time.monotonic() < deadline, f"still running: {[r.name for r in runs if r.proc.poll() is None]}"
        for run, iteration in runs.items():
            if run in sent:
                if run.seconds_to_exit is None and run.proc.poll() is not None:
                    run.seconds_to_exit = time.monotonic() - sent[run]
                continue
            assert run.proc.poll() is None, f"{run.name} ended (status {run.proc.returncode}) before its signal"
            last = logged(run.cwd / run.folder)
            if last >= iteration:
                run.proc.send_signal(signal.SIGTERM)
                sent[run], run.signalled_after = time.monotonic(), last
        time.sleep(0.01)
    for run in runs:
        run.seconds_to_exit = run.seconds_to_exit or time.monotonic() - sent[run]


def write_text_files(folder: Path) -> list[str]:
    """finetune.py's GPT data flags over two small jsonl files written in ``folder``."""
    train, valid = folder / "train.jsonl", folder / "valid.jsonl"
    train.write_text("".join(f'{{"text": "the quick brown fox number {i} jumps over the lazy dog"}}\n'
                             for i in range(40)))
    valid.write_text("".join(f'{{"text": "a lazy dog number {i}"}}\n' for i in range(8)))
    return ["--train-data", str(train), "--valid-data", str(valid)]


@pytest.fixture(scope="module")
def sigterm(tmp_path_factory) -> dict[str, Launched]:
    root = tmp_path_factory.mktemp("sigterm")
    (root / "status.py").write_text(STATUS_WRAPPER)
    at = {"one": random.randint(1, ITERS // 2), "four": random.randint(1, ITERS // 2)}
    print(f"SIGTERM after logged iteration {at}")
    wrapped = command(FLAGS + ["--save", "four"], MESH)
    wrapped[wrapped.index(PRETRAIN)] = "status.py"
    wrapped.insert(wrapped.index("status.py") + 1, PRETRAIN)
    wrapped.insert(wrapped.index("--standalone"), "--shutdown-timeout=120")  # not 30 s: a loaded machine saves slowly
    runs = {name: Launched(name, cmd, root) for name, cmd in [
        ("whole", command(FLAGS + ["--save", "whole"])), ("one", command(FLAGS + ["--save", "one"])),
        ("four", wrapped)]}
    sigterm_at({runs["one"]: at["one"], runs["four"]: at["four"]})
    runs["four"].status = [(root / f"status.{r}").read_text() for r in range(4)]
    assert runs["whole"].wait() == 0, runs["whole"].stderr[-3000:]
    ft = [sys.executable, str(ROOT / "finetune.py"), "--load", "whole", *write_text_files(root), "--epochs", "3",
          "--global-batch-size", "8", "--micro-batch-size", "4", "--seq-length", "16", "--log-interval", "1",
          "--exit-interval", "7", "--save", "finetuned"]
    runs.update((name, Launched(name, cmd, root)) for name, cmd in [  # saving apart: the stopped runs stay as they were
        ("one-resumed", command(FLAGS + ["--load", "one", "--save", "one-resumed", "--exit-interval",
                                         str(EXIT_INTERVAL)])),
        ("four-resumed", command(FLAGS + ["--load", "four", "--save", "four-resumed", "--exit-duration-in-mins",
                                          str(EXIT_MINUTES)])), ("finetune", ft)])
    for name in ("one-resumed", "four-resumed", "finetune"):
        runs[name].wait()
    return runs


def check_stopped(run: Launched, reason: str) -> int:
    """One line says why ``run`` stopped and where it saved; the checkpoint of that iteration is ``latest``
    and the last logged; returns that iteration."""
    lines = [line for line in run.stdout.splitlines() if line.startswith("stopped at iteration")]
    assert len(lines) == 1, run.stdout[-3000:]
    found = re.fullmatch(rf"stopped at iteration (\d+) of {ITERS}: {reason}; checkpoint: (\S+) "
                         rf"\(resume with --load {run.folder}\)", lines[0])
    assert found, lines[0]
    stop = int(found.group(1))
    assert found.group(2) == f"{run.folder}/iter_{stop:07d}"
    assert (run.cwd / run.folder / "latest").read_text().strip() == f"iter_{stop:07d}"
    assert (run.cwd / found.group(2) / "meta.json").is_file()
    assert logged(run.cwd / run.folder) == stop
    return stop


@pytest.mark.parametrize("name", ["one", "four"])
def test_sigterm_finishes_the_step_saves_and_exits_0(sigterm, name):
    run = sigterm[name]
    stop = check_stopped(run, "SIGTERM received")
    print(f"{name}: SIGTERM after iteration {run.signalled_after} was logged; stopped at {stop}, "
          f"{run.seconds_to_exit:.1f} s later")
    assert run.signalled_after <= stop <= run.signalled_after + 2  # the step under way (one more if its line raced)
    if name == "one":
        assert run.proc.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    else:  # the workers exit 0; torchrun's agent itself raises on the signal it forwarded
        assert run.status == ["0"] * 4, (run.status, run.stderr[-3000:])
        assert "forcefully exiting" not in run.stderr and "pretrain.py" not in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("name", ["one", "four"])
def test_sigterm_then_load_logs_what_the_uninterrupted_run_logged(sigterm, name):
    run = sigterm[f"{name}-resumed"]
    assert run.proc.returncode == 0, run.stderr[-3000:]
    stop, end = logged(run.cwd / name), logged(run.cwd / run.name)
    assert f"resumed from {name}/iter_{stop:07d} at iteration {stop} " in run.stdout, run.stdout[:2000]
    whole, resumed = metrics(run.cwd / "whole"), {**metrics(run.cwd / name), **metrics(run.cwd / run.name)}
    assert sorted(whole) == list(range(1, ITERS + 1)) and sorted(resumed) == list(range(1, end + 1)) and stop < end
    whole = {i: whole[i] for i in resumed}
    if name == "one":  # the same mesh: exactly
        assert [[r.get(f) for f in FIELDS] for r in resumed.values()] == [[r.get(f) for f in FIELDS]
                                                                           for r in whole.values()]
    else:
        worst = max(rel(resumed[i][f], whole[i][f]) for i in whole for f in FIELDS if f in whole[i])
        print(f"stopped at 4 ranks, resumed on 1: largest relative difference from the single process {worst:.1e}")
        assert worst <= LOSS_TOL


@pytest.mark.parametrize("name, reason", [("one", f"--exit-interval {EXIT_INTERVAL} reached"),
                                          ("four", f"--exit-duration-in-mins {EXIT_MINUTES} reached")])
def test_exit_flags_save_and_exit_0(sigterm, name, reason):
    """The resumed runs: one process with --exit-interval, the other with --exit-duration-in-mins."""
    run = sigterm[f"{name}-resumed"]
    assert run.proc.returncode == 0, run.stderr[-3000:]
    stop = check_stopped(run, reason)
    assert stop == EXIT_INTERVAL if name == "one" else logged(run.cwd / name) < stop < ITERS


def test_finetune_exit_interval_validates_saves_and_exits_0(sigterm):
    run = sigterm["finetune"]
    assert run.proc.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^stopped at iteration 7 \(epoch 1\): --exit-interval 7 reached; best val_loss \S+ \(epoch 1\); "
                     r"checkpoint finetuned/best; last checkpoint finetuned/iter_0000007; ", run.stdout, re.M), \
        run.stdout[-2000:]
    assert (run.cwd / "finetuned" / "latest").read_text().strip() == "iter_0000007"
    log = [json.loads(line) for line in (run.cwd / "finetuned" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in log] == list(range(1, 8)), log  # one line per step, the last one validated
    assert "val_loss" in log[-1] and not log[-1]["skipped"]


# in-process: the handler, the rules, the flags


@pytest.mark.tier("unit")
def test_signal_flag_catches_sigterm_and_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in stopping.SIGNALS}
    with SignalFlag() as flag:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a repeat (a scheduler and torchrun both) changes nothing
        assert flag.received == signal.SIGTERM
    assert {s: signal.getsignal(s) for s in stopping.SIGNALS} == before


@pytest.mark.tier("unit")
def test_second_sigint_kills_unless_it_is_torchruns_copy(monkeypatch):
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN under nohup / in a job
    with SignalFlag() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # at once: torchrun forwarding the terminal's Ctrl-C
        assert flag.received == signal.SIGINT
        monkeypatch.setattr(stopping, "SIGINT_GRACE_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == before  # restored at once


@pytest.mark.tier("unit")
def test_stop_rules_reasons():
    import torch

    cpu = torch.device("cpu")
    assert StopRules(cpu, None, exit_interval=5).reason(4) is None
    assert StopRules(cpu, None, exit_interval=5).reason(10) == "--exit-interval 5 reached"
    assert StopRules(cpu, None, exit_minutes=1.0).reason(3) is None
    assert StopRules(cpu, None, exit_minutes=1.0, started=time.monotonic() - 61).reason(3) == \
        "--exit-duration-in-mins 1 reached"
    with StopRules(cpu, SignalFlag(), exit_interval=5) as rules:
        os.kill(os.getpid(), signal.SIGTERM)
        assert rules.reason(10) == "SIGTERM received"  # a signal is named before the interval


def ranks_agree() -> tuple[list[str | None], str | None, str | None]:
    """On 2 ranks: rank 1 alone gets SIGTERM during step 3; then a duration past on rank 0's clock
    only, and on rank 1's only."""
    import torch.distributed as dist

    from tpzoo.parallel import init_mesh

    device, rank, now = init_mesh(1, 1, 2).device, dist.get_rank(), time.monotonic()
    reasons = []
    with StopRules(device, SignalFlag()) as rules:
        for iteration in range(1, 5):
            if rank == 1 and iteration == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            reasons.append(rules.reason(iteration))
    late = [StopRules(device, None, exit_minutes=1.0, started=now - 61 if rank == late_rank else now).reason(1)
            for late_rank in (0, 1)]
    return reasons, *late


@pytest.mark.tier("distributed")
def test_every_rank_stops_at_the_same_iteration():
    from tpzoo.testing import spawn

    expected = ([None, None, "SIGTERM received", "SIGTERM received"], "--exit-duration-in-mins 1 reached", None)
    assert spawn(ranks_agree, 2) == [expected, expected]


@pytest.mark.tier("unit")
def test_stopping_flags_parse_check_and_stay_with_their_launch():
    import argparse

    sys.path.insert(0, str(ROOT))
    try:
        from finetune import parser as finetune_parser
        from pretrain import parser
    finally:
        sys.path.remove(str(ROOT))
    from tpzoo.training.run_config import StoppingConfig, section_of
    from tpzoo.training.resolve import restore_args

    args = parser().parse_args([])
    assert (args.exit_signal_handler, args.exit_interval, args.exit_duration_in_mins, args.max_skipped_steps) == \
        (True, None, None, 10)
    flags = "--no-exit-signal-handler --exit-interval 5 --exit-duration-in-mins 0.5 --max-skipped-steps 3".split()
    for p in (parser(), finetune_parser()):
        args = p.parse_args(flags)
        assert (args.exit_signal_handler, args.exit_interval, args.exit_duration_in_mins, args.max_skipped_steps) == \
            (False, 5, 0.5, 3)
    stopping = section_of(StoppingConfig, vars(args))
    with SignalFlag() as outer, StopRules.of(stopping, None):  # --no-exit-signal-handler: no handler of its own
        assert signal.getsignal(signal.SIGTERM) == outer._handle
    args = argparse.Namespace(exit_signal_handler=True, exit_interval=None, exit_duration_in_mins=None,
                              max_skipped_steps=10, lr=1.0)
    saved = dict(exit_signal_handler=False, exit_interval=5, exit_duration_in_mins=2.0, max_skipped_steps=3, lr=2.0)
    restore_args(args, set(), saved)  # a resume takes the run's flags, not the launch's
    assert vars(args) == dict(exit_signal_handler=True, exit_interval=None, exit_duration_in_mins=None,
                              max_skipped_steps=10, lr=2.0)
    for bad in ("--exit-interval 0", "--exit-duration-in-mins 0", "--max-skipped-steps 0", "--exit-interval x"):
        with pytest.raises(SystemExit) as exited:
            parser().parse_args(bad.split())
        assert exited.value.code == 2
