"""The command lines of pretrain.py and finetune.py: flags are checked before torch loads, --help
states each default once, and a resume can tell the flags written on the command line from the
defaults (CommandParser.given)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from doc_helpers import ROOT, clean_env, run_as_needed

pytestmark = pytest.mark.tier("unit")



SCRIPTS = ("pretrain.py", "finetune.py")


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    """A PYTHONPATH entry whose ``torch`` fails to import: a script that loads it fails loudly."""
    root = tmp_path_factory.mktemp("no-torch")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text("raise ImportError('torch was imported before the flags were checked')\n")
    return root


@pytest.mark.tier("journey")
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flags, problem", [
    ("--lr 0", "argument --lr: expected a number > 0, got 0"),
    ("--micro-batch-size 0", "argument --micro-batch-size: expected an integer >= 1, got 0"),
    ("--hidden-dropout 1.5", "argument --hidden-dropout: expected a number in [0, 1), got 1.5"),
    ("--weight-decay -0.1", "argument --weight-decay: expected a number >= 0, got -0.1"),
], ids=["lr", "micro-batch", "dropout", "weight-decay"])
def test_flag_errors_come_before_torch_loads(no_torch, script, flags, problem):
    env = {**clean_env(1), "PYTHONPATH": f"{no_torch}:{ROOT}"}
    done = subprocess.run([sys.executable, str(ROOT / script), *flags.split()], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and problem in done.stderr, done.stderr


@pytest.mark.tier("journey")
def test_pretrain_min_lr_above_lr_is_refused_before_torch_loads(no_torch):
    env = {**clean_env(1), "PYTHONPATH": f"{no_torch}:{ROOT}"}
    done = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), "--min-lr", "1"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 2 and "--min-lr 1.0 must lie in [0, --lr 0.003]" in done.stderr, done.stderr


def help_entries(text: str) -> dict[str, str]:
    """--help text -> {first flag: its whole entry (flag line and wrapped help)}."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        found = re.match(r"  (-[-\w]+)", line)
        if found:
            flag = found.group(1)
            entries[flag] = line
        elif flag and line.startswith("      "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


@pytest.mark.tier("journey")
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_states_each_default_once(script):
    done = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                          env=clean_env(1), timeout=60)
    assert done.returncode == 0, done.stderr
    entries = help_entries(done.stdout)
    assert "--lr" in entries and "--seed" in entries
    twice = {flag: entry for flag, entry in entries.items() if entry.lower().count("default") > 1}
    assert not twice, twice
    assert "(default: None)" not in done.stdout and "(default: False)" not in done.stdout
    assert re.search(r"--seed SEED\s+default: 1234", done.stdout), "a flag without help text still shows its default"


def test_pretrain_help_gives_the_defaults_of_each_model():
    sys.path.insert(0, str(ROOT))
    try:
        from pretrain import parser
    finally:
        sys.path.remove(str(ROOT))
    text = " ".join(parser().format_help().split())
    assert "default: gpt 300, bert 1000" in text and "default: gpt 0.003, bert 0.001" in text


def test_given_tells_written_flags_from_defaults():
    from tpzoo.training.args import add_parallel_args, add_precision_args, add_run_args, command_parser
    from tpzoo.training.optimizer_args import add_optimizer_args

    p = command_parser("x", "x")
    add_parallel_args(p)
    add_optimizer_args(p)
    add_precision_args(p)
    assert p.given([]) == set()
    assert p.given(["--tp", "2", "--lr", "1e-3", "--bf16"]) == {"tp", "lr", "bf16"}
    assert p.given(["--tensor-model-parallel-size", "1", "--seed", "1234"]) == {"tp", "seed"}  # default values count
    run = command_parser("x", "x")
    add_run_args(run)
    assert run.parse_args(["--persistent-save-interval", "5"]).save_interval == 5  # Megatron-LM's other name


def plan(args, mesh):
    """The ParallelPlan of the parsed flags ``args`` on ``mesh``: their parallel, precision and speed sections."""
    from tpzoo.training.parallel_config import ParallelConfig, PrecisionConfig, SpeedConfig, plan_of
    from tpzoo.training.run_config import section_of

    sections = (section_of(c, vars(args)) for c in (ParallelConfig, PrecisionConfig, SpeedConfig))
    return plan_of(*sections, args.seed, mesh)


def pretrain_args(flags: list[str]):
    sys.path.insert(0, str(ROOT))
    try:
        from pretrain import parser
    finally:
        sys.path.remove(str(ROOT))
    return parser().parse_args(flags)


def test_local_rank_of_torch_distributed_launch_sets_or_must_match_local_rank(monkeypatch):
    """torch.distributed.launch passes --local-rank N: it becomes LOCAL_RANK (the device index tpzoo reads)
    when the launcher set none, and must agree with it when it did."""
    from tpzoo.training.args import add_parallel_args, command_parser
    from tpzoo.training.parallel_config import ParallelConfig
    from tpzoo.training.run_config import section_of

    p = command_parser("x", "x")
    add_parallel_args(p)

    def check_local_rank(args):
        section_of(ParallelConfig, vars(args)).check_launch()

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    check_local_rank(p.parse_args(["--local-rank", "1"]))
    assert os.environ["LOCAL_RANK"] == "1"
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="--local-rank 1 differs from the launcher's LOCAL_RANK 0"):
        check_local_rank(p.parse_args(["--local-rank", "1"]))
    check_local_rank(p.parse_args([]))  # not given: nothing to check


def test_model_config_takes_each_familys_default_preset_and_refuses_a_foreign_flag():
    """--model picks the family's default preset; a flag the family's config has no field for (or a
    preset of another family) is a ValueError naming it, and the run options are the plan's, not the config's."""
    from tpzoo.models.families import FAMILIES
    from tpzoo.training.model_args import ModelChoice, model_config

    for name, family in FAMILIES.items():
        config = model_config(ModelChoice.of(vars(pretrain_args(["--model", name, "--num-layers", "3"]))))
        assert config.model_type == name and config.num_layers == 3, config
        assert "sequence_parallel" not in config.to_dict() and "seed" not in config.to_dict()
    flagged = [n for n in FAMILIES
               if "num_query_groups" not in model_config(ModelChoice.of(vars(pretrain_args(["--model", n])))).to_dict()]
    assert flagged, "a family without grouped-query attention"
    with pytest.raises(ValueError, match=f"--num-query-groups does not apply to --model {flagged[0]}"):
        model_config(ModelChoice.of(vars(pretrain_args(["--model", flagged[0], "--num-query-groups", "2"]))))
    other = next(n for n in FAMILIES if n != flagged[0])
    with pytest.raises(ValueError, match=f"is a {other} model but --model is {flagged[0]}"):
        model_config(ModelChoice.of(vars(pretrain_args(["--model", flagged[0], "--preset",
                                                       FAMILIES[other].default_preset]))))


@pytest.mark.parametrize("script", SCRIPTS)
def test_compile_flag_makes_a_compiling_plan(script):
    """--compile (off by default) sets ParallelPlan.compile; where torch.compile cannot run, a ValueError
    naming the problem and its fix (the scripts turn it into one line and exit 2)."""
    sys.path.insert(0, str(ROOT))
    try:
        parser = __import__(script.removesuffix(".py")).parser
    finally:
        sys.path.remove(str(ROOT))
    from tpzoo.parallel import init_mesh

    mesh = init_mesh(tp=1)
    assert not plan(parser().parse_args([]), mesh).compile
    assert plan(parser().parse_args(["--compile"]), mesh).compile


@pytest.mark.parametrize("env, problem", [
    ({"TPZOO_COMPILE_BACKEND": "nonsense"}, "--compile: TPZOO_COMPILE_BACKEND=nonsense is not a torch.compile backend"),
    ({"TPZOO_COMPILE_MODE": "reduce-overhead"}, "TPZOO_COMPILE_MODE=reduce-overhead records CUDA graphs and needs a "
                                                "GPU; unset it on the cpu"),
    ({"CXX": "/no/such/compiler"}, "inductor on the CPU needs a C++ compiler and none was found"),
], ids=["backend", "reduce-overhead-on-cpu", "no-c++-compiler"])
def test_compile_refused_where_it_cannot_run(monkeypatch, env, problem):
    from tpzoo.parallel import init_mesh

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(problem)):
        plan(pretrain_args(["--compile"]), init_mesh(tp=1))


@pytest.mark.tier("journey")
def test_pretrain_compile_refusal_is_one_line_and_exit_2(tmp_path):
    env = {**clean_env(1), "TPZOO_COMPILE_BACKEND": "nonsense"}
    done = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), "--compile", "--train-iters", "1"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "pretrain.py: error: --compile: TPZOO_COMPILE_BACKEND=nonsense is not a torch.compile backend" in done.stderr


@pytest.mark.tier("journey")
def test_pretrain_with_compile_logs_the_eager_losses(tmp_path, monkeypatch):
    """A short pretrain.py run with --compile (aot_eager: what inductor traces, run eagerly) logs the
    losses of the same run without it (both runs at once)."""
    from pretrain_helpers import TINY, command, metrics

    monkeypatch.setenv("TPZOO_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setenv("TORCH_LOGS", "dynamo")  # dynamo says when it traces a frame
    flags = TINY + "--train-iters 4 --eval-interval 0 --kernels torch".split()
    runs = {"eager": [], "compiled": ["--compile"]}
    done = run_as_needed([shlex.join(command(flags + extra + ["--save", name])) for name, extra in runs.items()],
                         tmp_path)
    traced = {name: "torchdynamo start tracing forward" in d.stderr for name, d in zip(runs, done)}
    assert traced == {"eager": False, "compiled": True}, traced
    eager, compiled = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    assert eager.keys() == compiled.keys() == {1, 2, 3, 4}
    for step in eager:
        assert abs(compiled[step]["loss"] - eager[step]["loss"]) <= 1e-5 * abs(eager[step]["loss"]), (step, compiled,
                                                                                                    eager)
