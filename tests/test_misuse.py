"""Misuse of the five commands (pretrain.py, finetune.py, python -m tpzoo.data, python -m tpzoo.convert,
python -m tpzoo.generate): each case exits 2 with one stderr line ``<prog>: error: ...`` holding the
expected words, no traceback, and nothing written. The cases (``misuse_cases.CASES``, one pytest case
each: ``-k pretrain-empty-dataset``) run in ONE subprocess calling each command's main(argv); the few
that need a world size run on 2 spawned ranks (``RANK_CASES``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from doc_helpers import clean_env
from misuse_cases import CASES, PROGS, RANK_CASES
from misuse_runner import run_on_rank

from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("journey")




@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{"inputs": what the cases read, "results": {name: outcome}} of the runner, run once."""
    root = tmp_path_factory.mktemp("misuse")
    wandb_gone = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE")  # the W&B cases: no key anywhere
    env = {**{k: v for k, v in clean_env(1).items() if k not in wandb_gone}, "NETRC": str(root / "no-netrc"),
           "WANDB_CONFIG_DIR": str(root / "no-wandb-config")}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("misuse_runner.py")), str(root),
                           str(root / "results.json")], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return {**json.loads((root / "results.json").read_text()), "root": root}


def assert_misuse(outcome: dict, command: str, fragment: str) -> None:
    assert outcome["traceback"] is None, outcome["traceback"]
    lines = outcome["stderr"].splitlines()
    assert outcome["code"] == 2, (outcome["code"], outcome["stderr"])
    assert len(lines) == 1 and "Traceback" not in outcome["stderr"], outcome["stderr"]
    assert lines[0].startswith(PROGS[command]) and ": error: " in lines[0], lines[0]
    assert fragment in lines[0], (fragment, lines[0])
    assert outcome["changed"] == [], f"misuse must write nothing, but changed {outcome['changed']}"


@pytest.mark.tier("unit")
def test_at_least_80_distinct_cases():
    assert len(CASES) + len(RANK_CASES) >= 80
    assert len({(command, argv) for command, argv, _ in CASES.values()}) == len(CASES)
    assert {command for command, *_ in CASES.values()} == set(PROGS)


@pytest.mark.parametrize("name", CASES)
def test_misuse(results, name):
    command, _, fragment = CASES[name]
    assert_misuse(results["results"][name], command, fragment)


@pytest.fixture(scope="module")
def rank_results(results) -> list[dict]:
    return spawn(run_on_rank, 2, results["inputs"], str(results["root"] / "ranks"), timeout=300)


@pytest.mark.parametrize("name", RANK_CASES)
def test_misuse_on_2_ranks(rank_results, name):
    """Every rank exits 2; rank 0 alone says why, in one line."""
    command, _, fragment = RANK_CASES[name]
    assert_misuse(rank_results[0][name], command, fragment)
    quiet = rank_results[1][name]
    assert quiet["code"] == 2 and quiet["stderr"] == "" and quiet["traceback"] is None, quiet
