"""Configuration files (docs/config.md): ``--config run.toml`` stands for the flags it spells (checked as they are,
overridden by those given, counted as given), ``--print-config`` prints the resolved run (a resume's merged with
its checkpoint's) and a run given by the printed file logs the same losses as the run given by flags; misuse is
one line naming the file, section and key. The reference in docs/config.md matches the parsers."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from doc_helpers import ROOT, commands
from families import CAUSAL_LM
from pretrain_helpers import TINY, metrics, pretrain, run, script

from tpzoo.training.config_file import CONFIG_FILE, file_argv, reference, sections

pytestmark = pytest.mark.tier("unit")



PRETRAIN, FINETUNE = script("pretrain"), script("finetune")
FIXTURE = ROOT / "tests" / "fixtures" / "checkpoint_v2" / CAUSAL_LM.family


def config_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def printed(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    PRETRAIN.main([*argv, "--print-config"])
    return capsys.readouterr().out


def test_the_file_stands_for_its_flags_and_flags_given_override_it(tmp_path):
    path = config_file(tmp_path, '[model]\nnum_layers = 3\n\n[parallel]\ntp = 2\nsequence_parallel = true\n\n'
                                 '[batch_and_optimizer]\nrampup_batch_size = [8, 8, 64]\nlr = 0.01\n\n'
                                 '[logging]\nlog_loss_scale_to_tensorboard = false\n')
    p = PRETRAIN.parser()
    args = p.parse_args(["--config", path, "--lr", "0.02"])
    assert (args.num_layers, args.tp, args.sequence_parallel, args.rampup_batch_size, args.lr) == (3, 2, True,
                                                                                                   [8, 8, 64], 0.02)
    assert args.log_loss_scale_to_tensorboard is False and args.config is None
    assert {"num_layers", "tp", "sequence_parallel", "rampup_batch_size", "lr"} <= p.given(["--config", path])


def test_a_yaml_file_stands_for_the_same_flags(tmp_path):
    """run.yaml: the sections and keys of run.toml (YAML's 1e-3 is text to it: the flag reads it as a number)."""
    toml = config_file(tmp_path, '[model]\nnum_layers = 3\n\n[parallel]\ntp = 2\nsequence_parallel = true\n\n'
                                 '[batch_and_optimizer]\nrampup_batch_size = [8, 8, 64]\nlr = 0.001\n')
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model:\n  num_layers: 3\nparallel:\n  tp: 2\n  sequence_parallel: true\n"
                    "batch_and_optimizer:\n  rampup_batch_size: [8, 8, 64]\n  lr: 1e-3\n")
    p = PRETRAIN.parser()
    assert vars(p.parse_args(["--config", str(yaml)])) == vars(p.parse_args(["--config", toml]))
    for text, message in (("parallel:\n  tpp: 2\n", "[parallel] has no key tpp"),
                          ("parallel: [tp\n", "not a YAML file"), ("- tp\n", "a YAML file of sections")):
        yaml.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"--config {yaml}: ") + ".*" + re.escape(message)):
            file_argv(p, str(yaml))


@pytest.mark.parametrize("text, message", [
    ("[parallel]\ntp = 'two'\n", "[parallel] tp = 'two': argument --tensor-model-parallel-size/--tp: expected an "
                                 "integer >= 1, got 'two'"),
    ("[parallel]\ntp = '2'\n", "[parallel] tp = '2': a number, not a string; drop the quotes"),
    ("[parallel]\ntp = 0\n", "[parallel] tp = 0: argument --tensor-model-parallel-size/--tp: expected an integer >= 1"),
    ("[model]\nhidden_dropout = 1.5\n", "[model] hidden_dropout = 1.5: argument --hidden-dropout: expected a number "
                                        "in [0, 1)"),
    ("[parallel]\ntpp = 2\n", "[parallel] has no key tpp; its keys: tp, pp, dp"),
    ("[model]\ntp = 2\n", "[model] has no key tp (tp is a key of [parallel])"),
    ("[paralel]\ntp = 2\n", "no section [paralel]; the sections are model, model_architecture, parallel"),
    ("tp = 2\n", "no section [tp]; the sections are model"),
    ("[parallel]\nsequence_parallel = 3\n", "[parallel] sequence_parallel = 3 is not a value --sequence-parallel "
                                            "takes"),
    ("[batch_and_optimizer]\nrampup_batch_size = 8\n", "rampup_batch_size = 8: argument --rampup-batch-size: "
                                                       "expected 3 arguments"),
    ("[batch_and_optimizer]\nlr = [1, 2]\n", "[batch_and_optimizer] lr = [1, 2] is not a value --lr takes"),
    ("[data]\ntokenizer_type = 'TikTokenizer'\n", "--tokenizer-type TikTokenizer is a Megatron-LM tokenizer"),
    ("[parallel\ntp = 2\n", "not a TOML file"),
    (None, "cannot read it (No such file or directory)"),
])
def test_a_bad_file_is_one_line_naming_file_section_and_key(tmp_path, capsys, text, message):
    path = config_file(tmp_path, text) if text is not None else str(tmp_path / "missing.toml")
    with pytest.raises(SystemExit) as exit:
        PRETRAIN.parser().parse_args(["--config", path])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"pretrain.py: error: --config {path}: ") and message in err, err


def test_printed_config_is_every_resolved_value_and_reads_back_the_same(tmp_path, capsys):
    flags = [*TINY, "--model", CAUSAL_LM.family, "--sequence-parallel", "--tp", "2",
             "--rampup-batch-size", "4", "4", "32"]
    text = printed(flags, capsys)
    assert f'[model]\nmodel = "{CAUSAL_LM.family}"\n' in text and "rampup_batch_size = [4, 4, 32]" in text
    assert "sequence_parallel = true" in text and "exit_signal_handler = true" in text
    assert "train_iters = " in text and "lr_decay_style = " in text  # the family's schedule, resolved
    assert "print_config" not in text and "config =" not in text
    path = config_file(tmp_path, text)
    assert printed(["--config", path], capsys) == text
    assert "num_layers = 3" in printed(["--config", path, "--num-layers", "3"], capsys)


def test_a_family_the_architecture_flags_describe_stays_described(capsys):
    """Without --model the flags pick the family and its Megatron-LM defaults (tied, one kv head per head); the
    printed file leaves the family to them again, so it builds the same model."""
    text = printed([*TINY, "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                    "--disable-bias-linear"], capsys)
    assert "\nmodel = " not in text and 'normalization = "RMSNorm"' in text and "swiglu = true" in text


def test_print_config_of_a_resume_merges_the_checkpoints_flags(tmp_path, capsys):
    """The fixture checkpoint's recorded flags (tp 2, sequence parallel, its sizes) where none are given."""
    load = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, load)
    text = printed(["--load", str(load), "--train-iters", "9"], capsys)
    assert "\ntp = 1\n" in text  # the mesh is the launch's (the checkpoint ran at tp 2)
    assert "num_layers = 2" in text and "hidden_size = 8" in text and "train_iters = 9" in text
    assert f'load = "{load}"' in text


def test_finetune_prints_its_flags(tmp_path, capsys):
    FINETUNE.main(["--load", str(tmp_path), "--task", "demo", "--epochs", "2", "--print-config"])
    text = capsys.readouterr().out
    assert "[fine_tuning]\n" in text and "epochs = 2" in text and 'task = "demo"' in text


def test_docs_reference_matches_the_parsers():
    text = (ROOT / "docs" / "config.md").read_text()
    pretrain_part = text.split("\n## pretrain.py\n\n")[1].split("\n## finetune.py\n\n")[0]
    finetune_part = text.split("\n## finetune.py\n\n")[1]
    assert pretrain_part.rstrip() == reference(PRETRAIN.parser()).rstrip(), "regenerate docs/config.md's reference"
    assert finetune_part.rstrip() == reference(FINETUNE.parser()).rstrip(), "regenerate docs/config.md's reference"
    assert [f"[{name}]" for name in sections(PRETRAIN.parser())] == [
        line.removeprefix("### ") for line in pretrain_part.splitlines() if line.startswith("### ")]


@pytest.mark.tier("journey")
def test_a_run_from_the_printed_file_logs_the_same_losses_as_from_flags(tmp_path):
    """docs/config.md's commands: the run given by flags, its printed file, the run given by that file (the
    --save and --train-iters flags override it); each run folder's config.toml is the printed file."""
    shown = commands("config.md")
    assert shown[0].endswith("--print-config > run.toml") and shown[1] == "python pretrain.py --config run.toml " \
                                                                          "--train-iters 20"
    flags = [*shown[0].split()[2:-3], *TINY[8:], "--train-iters", "4", "--save", "by-flags"]
    start = pretrain(flags, tmp_path).stdout.splitlines()[:4]  # the run's summary, before its first step
    assert re.fullmatch(rf"model     {CAUSAL_LM.family}, [\d.]+M parameters \(2 layers, hidden 32, 4 heads\), fp32",
                        start[0]), start
    assert start[1] == "mesh      tp 1 x pp 1 x dp 1 = 1 ranks, 1f1b schedule", start
    size = r"[\d.]+ [KMG]iB"
    assert re.fullmatch(rf"memory    about {size} per rank: weights {size}, gradients {size}, main weights 0 KiB, "
                        rf"optimizer state {size} \(rank 0's shards; activations not counted\)", start[2]), start
    assert re.fullmatch(r"data      .+ \(tokenizer: \d+ tokens\), [\d,]+ train samples of 16 tokens, [\d,]+ "
                        r"validation; the run reads 32 \(4 iterations\)", start[3]), start
    done = run([sys.executable, str(ROOT / "pretrain.py"), *flags, "--print-config"], tmp_path)
    assert done.returncode == 0, done.stderr
    (tmp_path / "run.toml").write_text(done.stdout)
    checkpoint = tmp_path / "by-flags" / "iter_0000004"
    for folder in (tmp_path / "by-flags", checkpoint):  # the run folder's and the checkpoint's, in its manifest
        assert (folder / CONFIG_FILE).read_text() == done.stdout, folder
    assert CONFIG_FILE in json.loads((checkpoint / "manifest.json").read_text())["files"]
    pretrain(["--config", "run.toml", "--save", "by-file", "--train-iters", "4"], tmp_path)
    by_flags, by_file = metrics(tmp_path / "by-flags"), metrics(tmp_path / "by-file")
    assert [r["loss"] for r in by_file.values() if "loss" in r] == [r["loss"] for r in by_flags.values() if "loss" in r]
    assert len(by_flags) >= 4
