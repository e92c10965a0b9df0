"""bench/models.py on the CPU: the docs' command as a smoke run (every contender of every family, the
same first loss, ratios from the same run), the skip and one-after-another paths under a small
memory budget, bad flags, and the MFU formula against the FLOPs of known shapes.

Two spawns of the script (the smoke run and the budget run); the rest imports it in this process.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
from doc_helpers import ROOT, clean_env, commands
from families import CASES, CAUSAL_LM, CAUSAL_LM_SMALL, GQA_LM_1B, MAIN, MASKED_LM_LARGE, MOE_LM

from tpzoo.models import get_preset

pytestmark = pytest.mark.tier("journey")



BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))  # its modules import each other (baselines, flops) as the script does
_spec = importlib.util.spec_from_file_location("bench_models", BENCH / "models.py")
bench = sys.modules["bench_models"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
FLOAT32_LOSS_RTOL = 1e-4  # float32 on the CPU: eager, compiled, Hugging Face and plain start within this


def run_bench(args: list[str]) -> subprocess.CompletedProcess:
    """``args`` (a python command line) from the repository root on the CPU: Triton compiles nothing, kernels
    and compile backend are the script's defaults."""
    drop = ("TRITON_INTERPRET", "TPZOO_KERNELS", "TPZOO_COMPILE_BACKEND", "TPZOO_COMPILE_MODE")
    env = {k: v for k, v in clean_env(1).items() if k not in drop}
    return subprocess.run(args, cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                          text=True, timeout=300)


def rows(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """The Markdown table's rows, as (model, contender) -> {column: cell}."""
    header, _, *lines = [line for line in stdout.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    cells = [dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))) for line in lines]
    return {(c["model"], c["contender"]): c for c in cells}


@pytest.fixture(scope="module")
def smoke() -> tuple[subprocess.CompletedProcess, dict]:
    shown = [c for c in commands("benchmarks.md") if "bench/models.py" in c]
    assert shown == ["python bench/models.py"], shown
    done = run_bench([sys.executable, *shown[0].split()[1:]])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, rows(done.stdout)


@pytest.mark.tier("unit")
def test_smoke_covers_every_family():
    assert set(bench.DEFAULT_MODELS) == {CASES[name].preset for name in MAIN} | {MOE_LM.preset}


def test_smoke_says_cpu_times_are_no_result(smoke):
    done, table = smoke
    assert done.stdout.startswith("device: CPU") and "; fp32;" in done.stdout.splitlines()[0], done.stdout
    assert "CPU times are not performance results" in done.stdout.splitlines()[1], done.stdout
    assert all(c["MFU"] == "-" and c["peak GiB"] == "-" for c in table.values()), done.stdout


@pytest.mark.parametrize("model", bench.DEFAULT_MODELS)
def test_smoke_every_contender_runs(smoke, model):
    done, table = smoke
    has_plain = bench.REFERENCES[get_preset(model).model_type].plain is not None
    for name in bench.DEFAULT_CONTENDERS:
        cells = table[model, name]
        if name.startswith("plain") and not has_plain:
            assert cells["ms/step"].startswith("skipped: no plain PyTorch"), cells
            continue
        assert 0 < float(cells["ms/step"]) <= float(cells["median ms"]), cells
        assert cells["shape"] == "{}x{}".format(*bench.SHAPES[model]), cells


@pytest.mark.parametrize("model", bench.DEFAULT_MODELS)
def test_smoke_first_losses_agree(smoke, model):
    _, table = smoke
    first = {name: float(c["loss@0"]) for (m, name), c in table.items() if m == model and c["loss@0"] != "-"}
    assert len(first) >= 4 and all(math.isfinite(v) for v in first.values()), first
    assert max(first.values()) - min(first.values()) <= FLOAT32_LOSS_RTOL * abs(first["tpzoo"]), first
    for name, c in table.items():
        if name[0] == model and c["loss@0"] != "-":
            assert math.isclose(float(c["d loss@0"]), first[name[1]] - first["tpzoo"], abs_tol=1e-4), c


@pytest.mark.parametrize("model", bench.DEFAULT_MODELS)
def test_smoke_ratios_come_from_the_same_run(smoke, model):
    _, table = smoke
    mine = {name: c for (m, name), c in table.items() if m == model and c["loss@0"] != "-"}
    tokens = {name: float(c["tokens/s"].replace(",", "")) for name, c in mine.items()}
    checked = 0
    for ref in bench.RATIO_TO:
        for name, c in mine.items():
            if ref not in mine:
                assert c[f"x {ref}"] == "-", c
                continue
            assert math.isclose(float(c[f"x {ref}"]), tokens[name] / tokens[ref], rel_tol=0.02, abs_tol=0.01), c
            checked += 1
    assert checked >= len(mine), mine


def test_budget_skips_what_does_not_fit_and_runs_the_rest_one_after_another():
    """A budget of 1.2 times a tiny model's state: its contenders fit one at a time but not together, so they
    run one after another; a model 2 times larger is skipped (and never built)."""
    def state(preset: str) -> int:
        return bench.STATE_BYTES * bench.parameter_counts(get_preset(preset, num_layers=2))[0]

    small = bench.DEFAULT_MODELS[0]
    big = next(m for m in bench.KNOWN_MODELS if state(m) > 2 * state(small))
    budget = 1.2 * state(small) / bench.GiB
    done = run_bench([sys.executable, "bench/models.py", "--models", f"{small},{big}", "--contenders", "tpzoo,hf",
                      "--memory-gib", f"{budget:.6f}", "--num-layers", "2"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = rows(done.stdout)
    assert set(table) == {(m, c) for m in (small, big) for c in ("tpzoo", "hf")}, done.stdout
    assert all(table[big, c]["ms/step"].startswith("skipped: its state needs") for c in ("tpzoo", "hf")), done.stdout
    assert all(float(table[small, c]["ms/step"]) > 0 for c in ("tpzoo", "hf")), done.stdout
    assert f"{small}: the contenders ran one after another" in done.stdout, done.stdout
    assert f"{big}: the contenders ran one after another" not in done.stdout, done.stdout


@pytest.mark.tier("unit")
@pytest.mark.parametrize("flags, message", [
    (["--models", "gpt-nano"], "unknown --models gpt-nano"),
    (["--contenders", "tpzoo,jax"], "unknown --contenders jax"),
    (["--models", CAUSAL_LM.preset, "--seq-length", "100000"],
     f"--seq-length 100000 exceeds the positions of {CAUSAL_LM.preset}"),
    (["--steps", "3", "--num-layers", "0"], "--steps, --warmup and --num-layers must be >= 1, got 3, 1 and 0"),
])
def test_bad_flags_exit_2_naming_the_problem(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        bench.main(flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.tier("unit")
def test_flops_per_token_of_known_shapes():
    """6 N + 12 L h s with N the published parameter counts (Hugging Face's) less the lookup-only tables:
    GPT-2 124M (positions), TinyLlama-1.1B (grouped-query attention; untied input embedding), BERT-large
    with its MLM head (positions and token types), and a mixture of experts counting the experts a token uses."""
    small = 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 768 * 1024
    assert bench.flops_per_token(get_preset(CAUSAL_LM_SMALL), 1024) == small
    assert bench.flops_per_token(get_preset(GQA_LM_1B), 2048) == 6 * (1_100_048_384 - 32000 * 2048) + \
        12 * 22 * 2048 * 2048
    assert bench.flops_per_token(get_preset(MASKED_LM_LARGE), 128) == 6 * (335_174_458 - (512 + 2) * 1024) + \
        12 * 24 * 1024 * 128
    # mixtral-1b: 1,507,133,440 parameters, 601,163,776 a token goes through (2 of 8 experts); its input embedding
    # is looked up only
    assert bench.flops_per_token(get_preset("mixtral-1b"), 2048) == 6 * (601_163_776 - 32000 * 2048) + \
        12 * 16 * 2048 * 2048
