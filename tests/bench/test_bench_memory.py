"""bench/memory.py, the docs' commands at CPU size, all at once (one OpenMP thread each): docs/parallelism.md's
``--check`` at dp 2 (the table there has dp 4 and 8 too), docs/benchmarks.md's GPT-2 XL command (pending a GPU) at
the tiny causal LM's preset on the CPU (dp 1 with and without FSDP, recompute, timed steps), its LoRA command
(llama-1b) at the tiny Llama's preset, and a misuse of --check; in the background from the start of the session (tests/background.py)."""

from __future__ import annotations

import re

import background
import pytest
from doc_helpers import ROOT, commands, run_as_needed
from families import CAUSAL_LM, CAUSAL_LM_XL, GQA_LM, GQA_LM_1B

pytestmark = pytest.mark.tier("journey")



MODES = ("plain", "zero1", "zero2", "fsdp")
SHOWN = {"parallelism.md": ["python bench/memory.py --check",
                            "python bench/memory.py --cp 1 2 4 --preset llama-tiny --seq-length 2048 --check"],
         "benchmarks.md": [f"python bench/memory.py --preset {CAUSAL_LM_XL} --dp 1 --modes plain fsdp --recompute",
                           f"python bench/memory.py --preset {GQA_LM_1B} --dp 1 --modes plain lora"]}
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
    for doc, shown in SHOWN.items():
        assert [c for c in commands(doc) if "bench/memory.py" in c] == shown, doc
    (check, context), (xl, lora) = SHOWN.values()
    done = run_as_needed([check + " --device cpu --dp 2", xl + f" --device cpu --preset {CAUSAL_LM.preset} --steps 1",
                          lora + f" --device cpu --preset {GQA_LM.preset} --steps 1", MISUSE,
                          context.replace("--seq-length 2048", "--seq-length 512")],
                         ROOT, timeout=300, check=False)
    return dict(zip(("sharding", "xl", "lora", "misuse", "context"), done))


def test_context_parallel_activations_fall_with_cp(runs):
    """The page's --cp table at 512 tokens: a row per cp and mode, each rank's bytes about 1/cp of cp 1's."""
    proc = runs["context"]
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "check: the bounds hold", proc.stdout + proc.stderr
    table = {(r[0], r[1]): float(r[3]) for r in (line.strip("|").split("|") for line in proc.stdout.splitlines()
                                                 if line.startswith("| ") and "---" not in line and "cp |" not in line)}
    table = {(cp.strip(), mode.strip()): ratio for (cp, mode), ratio in table.items()}
    assert list(table) == [("1", "-"), ("2", "p2p"), ("2", "a2a"), ("4", "p2p"), ("4", "a2a")], proc.stdout
    for (cp, _), ratio in table.items():
        assert ratio <= 1.25 / int(cp), proc.stdout


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


def test_lora_holds_no_float32_copy_gradient_or_optimizer_state_of_frozen_weights(runs):
    """bf16: full fine-tuning holds 2 + 4 bytes of weights, 4 of gradients and 8 of AdamW state per parameter; LoRA the
    frozen weights' 2 bytes and, for the adapters alone, those 18."""
    proc = runs["lora"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = rows(proc.stdout)
    plain, lora = table[1, "plain"], table[1, "lora"]
    assert lora["weights MiB"] < 0.4 * plain["weights MiB"], proc.stdout  # 2 of 6 bytes, and the adapters
    for part in ("gradients MiB", "optimizer MiB"):
        assert lora[part] < 0.05 * plain[part], proc.stdout  # the adapters' (llama-tiny at rank 8: 2.4%)
    assert min(f["tokens/s"] for f in table.values()) > 0, proc.stdout


def test_check_without_plain_is_refused(runs):
    proc = runs["misuse"]
    assert proc.returncode == 2 and not proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("memory.py: error: --check compares with plain data parallelism: "
                                                    "add plain to --modes")
