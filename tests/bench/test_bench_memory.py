"""bench/memory.py, the docs' commands at CPU size, all at once (one OpenMP thread each): docs/parallelism.md's
``--check`` at dp 2 (the table there has dp 4 and 8 too), docs/benchmarks.md's GPT-2 XL command (pending a GPU) at
the tiny causal LM's preset on the CPU (dp 1 with and without FSDP, recompute, timed steps), and a misuse of
--check; in the background from the start of the session (tests/background.py)."""

from __future__ import annotations

import re

import background
import pytest
from doc_helpers import ROOT, commands, run_as_needed
from families import CAUSAL_LM, CAUSAL_LM_XL

pytestmark = pytest.mark.tier("journey")



MODES = ("plain", "zero1", "zero2", "fsdp")
SHOWN = {"parallelism.md": "python bench/memory.py --check",
         "benchmarks.md": f"python bench/memory.py --preset {CAUSAL_LM_XL} --dp 1 --modes plain fsdp --recompute"}
MISUSE = "python bench/memory.py --check --modes fsdp"


def rows(stdout: str) -> dict[tuple[int, str], dict[str, float]]:
    """The Markdown table as (dp, mode) -> {column: number} (columns reading "-" left out)."""
    header, _, *lines = [line for line in stdout.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    out = {}
    for line in lines:
        cells = dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
        key = int(cells.pop("dp")), cells.pop("mode")
        out[key] = {k: float(v.replace(",", "")) for k, v in cells.items() if v != "-"}
    return out


@background.fixture
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    for doc, command in SHOWN.items():
        assert [c for c in commands(doc) if "bench/memory.py" in c] == [command], doc
    done = run_as_needed([SHOWN["parallelism.md"] + " --device cpu --dp 2",
                          SHOWN["benchmarks.md"] + f" --device cpu --preset {CAUSAL_LM.preset} --steps 1", MISUSE],
                         ROOT, timeout=300, check=False)
    return dict(zip(("sharding", "xl", "misuse"), done))


def test_sharding_table_meets_the_bounds(runs):
    proc = runs["sharding"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "check: the bounds hold", proc.stdout
    table = rows(proc.stdout)
    assert list(table) == [(2, mode) for mode in MODES], proc.stdout
    plain, zero1, zero2, fsdp = (table[2, mode] for mode in MODES)
    assert zero1["gradients MiB"] == plain["gradients MiB"] and zero1["weights MiB"] < plain["weights MiB"]
    assert fsdp["total MiB"] < zero2["total MiB"] < zero1["total MiB"] < plain["total MiB"], proc.stdout
    # bf16: plain 2 + 4 + 4 + 8 = 18 bytes per parameter, FSDP 16 / dp (the tiny preset's rows split evenly)
    assert fsdp["x plain"] == pytest.approx(16 / 18 / 2, abs=2e-3), proc.stdout
    assert fsdp["gathered MiB"] > 0 and "gathered MiB" not in plain, proc.stdout


def test_gpt2_xl_command_runs_at_dp1_with_and_without_fsdp(runs):
    proc = runs["xl"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.match(rf"{CAUSAL_LM.preset} \([\d.]+M parameters\), bf16, micro-batch 1 x 64 tokens per rank, "
                    r"recompute; CPU", proc.stdout), proc.stdout
    table = rows(proc.stdout)
    assert list(table) == [(1, "plain"), (1, "fsdp")], proc.stdout
    assert min(f["tokens/s"] for f in table.values()) > 0 and "peak GiB" not in table[1, "plain"]
    assert table[1, "fsdp"]["x plain"] == pytest.approx(16 / 18, abs=2e-3), proc.stdout  # float32 shards: no bf16 copy


def test_check_without_plain_is_refused(runs):
    proc = runs["misuse"]
    assert proc.returncode == 2 and not proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("memory.py: error: --check compares with plain data parallelism: "
                                                    "add plain to --modes")
