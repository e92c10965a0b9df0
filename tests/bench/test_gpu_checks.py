"""bench/gpu.sh, the GPU checks in one command: its dry run on the CPU (every part's command starts, the results
file lists them with their boxes), its refusals, and the time box of bench/gpu.py's parts (a part past its box is
killed with its children and the next part runs)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
from doc_helpers import ROOT, clean_env, commands

pytestmark = pytest.mark.tier("journey")



_spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
gpu = sys.modules["bench_gpu"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)
DEVICE_CALL_S = 600  # the most one device call may run


def gpu_sh(*args: str) -> subprocess.CompletedProcess:
    env = {**clean_env(), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_dry_run_starts_every_part_and_writes_the_results_file(tmp_path):
    done = gpu_sh("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    results = (tmp_path / "gpu-results.md").read_text()
    assert results.startswith("# GPU checks: device: no CUDA device; torch "), results
    assert "command: `bash bench/gpu.sh --dry-run --out" in results
    rows = {line.split("|")[1].strip(): line for line in results.splitlines() if line.startswith("| ")}
    names = [p.name for p in gpu.PARTS]
    assert names[:2] == ["suite", "kernels"] and {"models:gpt2", "models:llama-1b"} <= set(names)
    for part in gpu.PARTS:
        assert "dry run: starts" in rows[part.name] and "passed)" in rows[part.name], rows[part.name]
        assert rows[part.name].rstrip(" |").endswith(str(part.box_s)), rows[part.name]
    for group, members in gpu.GROUPS.items():  # one device call each, with the install and the start on top
        assert sum(p.box_s for p in gpu.PARTS if p.name in members) <= gpu.GROUP_BOX_S <= DEVICE_CALL_S - 60, group
    assert "tests collected" in (tmp_path / "suite.log").read_text()  # the GPU suite collects (skipped here)


def test_without_cuda_the_docs_commands_refuse_in_one_line(tmp_path):
    shown = [c for c in commands("benchmarks.md") if "bench/gpu.sh" in c]
    assert shown == ["bash bench/gpu.sh --parts checks --out gpu-results",
                     "bash bench/gpu.sh --parts models --out gpu-results-models",
                     "bash bench/gpu.sh --parts memory --out gpu-results-memory",
                     "bash bench/gpu.sh --parts experts --out gpu-results-experts"], shown
    for command in shown:
        done = gpu_sh(*command.split()[2:-1], str(tmp_path))
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.count("\n") == 1 and "no CUDA device here" in done.stderr and "--dry-run" in done.stderr
        assert not (tmp_path / "gpu-results.md").exists()


@pytest.mark.tier("unit")
@pytest.mark.parametrize("args, message", [
    (["--parts", "kernels,warp"], "--parts: no part warp; choose from the groups checks,models,memory,experts or the "
                                  "parts suite,kernels,models:gpt2"),
    (["--box", "suite=0"], "--box suite=0: expected PART=SECONDS"),
    (["--box", "nothing=5"], "--box nothing=5: expected PART=SECONDS"),
])
def test_bad_parts_and_boxes_exit_2_before_anything_runs(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        gpu.parse(args)
    assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.tier("unit")
def test_parts_and_boxes_chosen():
    args = gpu.parse(["--parts", "kernels,suite", "--box", "suite=30"])
    assert [(p.name, p.box_s) for p in args.parts] == [("suite", 30), ("kernels", 200)]  # PARTS' order
    assert [p.name for p in gpu.parse(["--parts", "checks"]).parts] == ["suite", "kernels"]
    assert [p.name for p in gpu.parse(["--parts", "models,suite"]).parts] == ["suite", "models:gpt2", "models:bert-large",
                                                                              "models:llama-1b", "models:gpt2-xl"]


def _part(code: str, box_s: int = 60) -> object:
    return gpu.Part("test", (sys.executable, "-c", code), box_s, ())


def test_a_part_past_its_box_is_killed_with_its_children(tmp_path, monkeypatch):
    """The part starts a child that outlives a SIGTERM to the part; both are gone soon after the box."""
    monkeypatch.setattr(gpu, "GRACE_S", 1)
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); print(child.pid, flush=True); "
            "time.sleep(60)")
    start = time.monotonic()
    outcome = gpu.run_part(_part(code, box_s=2), tmp_path / "slow.log")
    assert outcome.status == "timed out at 2 s" and 2 <= outcome.seconds < 10, outcome
    child = int(outcome.tail.split()[0])
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{child}") or "zombie" in open(f"/proc/{child}/status").read().lower()
    assert time.monotonic() - start < 10


def test_parts_report_exit_status_and_output(tmp_path):
    failed = gpu.run_part(_part("import sys; print('| a |'); sys.exit(3)"), tmp_path / "failed.log")
    passed = gpu.run_part(_part("print('| kernel | us |'); print('| --- | ---: |'); print('| gelu | 1.5 |')"),
                          tmp_path / "passed.log")
    assert failed.status == "failed, exit 3" and passed.status == "passed"
    text = gpu.report([failed, passed], "device: X", "bash bench/gpu.sh")
    assert "| test | failed, exit 3 |" in text and "| test | passed |" in text
    assert "```text\n| a |\n```" in text  # a failed part's output reads as text
    assert "\n| gelu | 1.5 |\n" in text and "```text\n| kernel" not in text  # a passed bench's table stays a table
