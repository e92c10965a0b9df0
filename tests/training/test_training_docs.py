"""The commands of README's quickstart and pretraining sections and of docs/training.md run as shown.

The quickstart's default run (300 iterations, a few minutes) runs here with --train-iters 20: the
same code path, shorter; its setup part must be CI's install without the test extras.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import background
import pytest
from doc_helpers import ROOT, commands, run_as_needed
from pretrain_helpers import metrics, run

pytestmark = pytest.mark.tier("journey")



QUICK_ITERS = 20


def section_commands(heading: str) -> list[str]:
    """The bash commands under README's ``## heading`` (up to the next ``## ``)."""
    section = (ROOT / "README.md").read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.splitlines()
            if line.strip()]


@background.fixture
def quickstart(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The default run, shortened: (its folder, its result)."""
    root = tmp_path_factory.mktemp("quickstart")
    (root / "pretrain.py").symlink_to(ROOT / "pretrain.py")
    return root, run([sys.executable, "pretrain.py", "--train-iters", str(QUICK_ITERS)], root)


def test_quickstart_is_ci_setup_then_the_default_run(quickstart):
    (quick,) = section_commands("Quickstart")
    *setup, train = quick.split(" && ")
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1].split(" && ")
    assert setup == [part.replace("-e '.[test]'", "-e .") for part in ci[:2]]
    assert train == ".venv/bin/python pretrain.py"
    tmp_path, done = quickstart
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"final loss (\S+), val loss \S+, unigram entropy of the training data (\S+) \(nats/token\)\n"
                      r"checkpoint: (\S+)\nmetrics: (\S+)", done.stdout)
    assert found, done.stdout
    final, entropy = float(found.group(1)), float(found.group(2))
    assert abs(entropy - 5.19) < 0.01
    log = metrics((tmp_path / found.group(4)).parent)
    assert final == round(log[QUICK_ITERS]["loss"], 4) and log[QUICK_ITERS]["loss"] < log[10]["loss"]
    assert (tmp_path / found.group(3) / "meta.json").is_file()


def shown() -> list[str]:
    return section_commands("Pretraining") + commands("training.md")


@background.fixture
def doc_runs(tmp_path_factory) -> Path:
    """The folder where each distinct command of ``shown`` ran once, after those it needs (--load runs/3d)."""
    root = tmp_path_factory.mktemp("training-docs")
    (root / "pretrain.py").symlink_to(ROOT / "pretrain.py")
    run_as_needed(list(dict.fromkeys(shown())), root)
    return root


def test_readme_and_training_doc_commands_run(doc_runs):
    assert len(shown()) >= 3 and any(c.startswith("torchrun") for c in shown())
    tmp_path, distinct = doc_runs, list(dict.fromkeys(shown()))
    for command in distinct:
        save = re.search(r"--save (\S+)", command)
        if save:
            assert (tmp_path / save.group(1) / "latest").is_file(), command
