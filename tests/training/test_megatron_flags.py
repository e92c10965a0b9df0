"""docs/megatron.md's table of Megatron-LM flags against pretrain.py's parser, in-process (no process per
flag): a supported flag parses with a valid value and a test file under tests/ uses it; a refused flag ends
parsing with exit status 2 and one line naming it and its REFUSED reason; every Megatron-LM flag of the parser
and every flag issue #17 names has a row. Select one flag with ``-k``, e.g. ``-k lr-decay-iters``."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys

import pytest
from doc_helpers import ROOT
from families import CAUSAL_LM

from tpzoo.training.megatron_refused import REFUSED

pytestmark = pytest.mark.tier("unit")



ROW = re.compile(r"^\| `(--[\w-]+)` \| ([^|]+) \| (supported|refused) \| (.*) \|$")
ROWS = {m[1]: (m[2], m[3], m[4]) for m in map(ROW.match, (ROOT / "docs/megatron.md").read_text().splitlines()) if m}
SUPPORTED = [flag for flag, (_, status, _) in ROWS.items() if status == "supported"]
REFUSED_ROWS = [flag for flag, (_, status, _) in ROWS.items() if status == "refused"]
# the parser's own flags that Megatron-LM does not have (each documented in docs/training.md)
TPZOO_ONLY = {"--model", "--preset", "--tp", "--pp", "--dp", "--cp", "--ep", "--data-parallel-size", "--vpp",
              "--virtual-pipeline-model-parallel-size", "--pipeline-schedule", "--kernels", "--compile", "--dataset",
              "--log-dir", "--max-skipped-steps", "--no-exit-signal-handler", "--dataset-config", "--dataset-split",
              "--add-bias-linear", "--json-key", "--config", "--print-config", "--elastic", "--save-interval-minutes",
              "--local-sgd-steps", "--outer-lr", "--fault-tolerance", "--ft-replica-id", "--ft-replica-groups",
              "--ft-min-replicas",
              "-h", "--help"}
# every flag issue #17 names
ISSUE = """--lr-decay-iters --lr-decay-samples --lr-warmup-fraction --lr-warmup-samples --train-samples
--rampup-batch-size --optimizer --adam-beta1 --adam-beta2 --adam-eps --init-method-std --tokenizer-type --vocab-file
--merge-file --tokenizer-model --vocab-size --make-vocab-size-divisible-by --position-embedding-type --rotary-base
--normalization --norm-epsilon --swiglu --untie-embeddings-and-output-weights --group-query-attention
--num-query-groups --disable-bias-linear --kv-channels --use-flash-attn --overlap-grad-reduce --recompute-granularity
--recompute-method --recompute-num-layers --train-data-path --valid-data-path --mock-data --data-cache-path
--num-workers --finetune --no-load-optim --no-load-rng --no-save-optim --no-save-rng --tensorboard-dir
--log-throughput --log-params-norm --log-num-zeros-in-grad --timing-log-level --wandb-project --wandb-exp-name
--wandb-save-dir --split --data-path --global-batch-size --micro-batch-size --train-iters --lr --min-lr
--lr-decay-style --weight-decay --clip-grad --fp16 --seq-length --max-position-embeddings --num-layers
--hidden-size --num-attention-heads --tensor-model-parallel-size --pipeline-model-parallel-size --save --load
--save-interval --eval-interval --eval-iters --log-interval --attention-backend""".split()
# supported flags no other test passes on a command line: the test here that does
WITNESSED = {"--ffn-hidden-size": "test_ffn_hidden_size_sets_the_mlp_width",
             "--exit-signal-handler": "test_exit_signal_handler_installs_the_handler"}
# values tried in turn for a flag that takes values: one of them parses
CANDIDATES = ("2", "0.5", "98,1,1", "0:16", "GPT2BPETokenizer", "x")


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT))
    try:
        from pretrain import parser
    finally:
        sys.path.remove(str(ROOT))
    return parser()


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[int | None, str]:
    """(exit status or None, stderr) of parsing ``argv``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            return e.code, err.getvalue()
    return None, err.getvalue()


def values(action: argparse.Action) -> list[list[str]]:
    """Arguments to try after ``action``'s flag: none for a switch, else its first choice or each candidate, as
    many times as its nargs asks."""
    if action.nargs == 0:
        return [[]]
    count = action.nargs if isinstance(action.nargs, int) else 1
    return [[str(c)] * count for c in ([next(iter(action.choices))] if action.choices else CANDIDATES)]


def uses(flag: str, note: str) -> str:
    """The test file a supported row's note names, checked to use ``flag``."""
    path = re.search(r"\(`(tests/[\w/]+\.py)`\)$", note)
    assert path, f"the note of {flag} names no test file: {note}"
    if path[1] == "tests/training/test_megatron_flags.py":  # the parse test below is no use of a flag
        assert flag in WITNESSED, f"{flag}: name a test that uses it, not the table's"
        return path[1]
    assert re.search(re.escape(flag) + r"(?![\w-])", (ROOT / path[1]).read_text()), f"{path[1]} does not use {flag}"
    return path[1]


def ids(flags: list[str]) -> list[str]:
    return [flag.removeprefix("--") for flag in flags]


@pytest.mark.parametrize("flag", SUPPORTED, ids=ids(SUPPORTED))
def test_supported_flag_parses_and_a_test_uses_it(parser, flag):
    action = parser._option_string_actions.get(flag)
    assert action is not None and flag not in REFUSED, f"{flag} is in the table as supported but pretrain.py lacks it"
    outcomes = [parse(parser, [flag, *tried]) for tried in values(action)]
    assert any(code is None for code, _ in outcomes), outcomes[0][1]
    uses(flag, ROWS[flag][2])


@pytest.mark.parametrize("flag", REFUSED_ROWS, ids=ids(REFUSED_ROWS))
def test_refused_flag_exits_2_with_one_line(parser, flag):
    assert flag in REFUSED, f"{flag} is in the table as refused but not in megatron_refused.REFUSED"
    assert ROWS[flag][2] == REFUSED[flag].replace("|", "\\|"), "the table's reason is not REFUSED's"
    code, err = parse(parser, ["--seed", "1", flag, "1", "2"])
    assert code == 2 and err.count("\n") == 1, (code, err)
    assert f"{flag} is a Megatron-LM flag tpzoo does not support: {REFUSED[flag]}" in err, err


def test_every_megatron_flag_of_the_parser_has_a_row(parser):
    unknown = set(parser._option_string_actions) - set(REFUSED) - set(ROWS) - TPZOO_ONLY
    assert not unknown, f"flags of pretrain.py neither in docs/megatron.md nor tpzoo's own: {sorted(unknown)}"
    assert not TPZOO_ONLY & set(ROWS), "a tpzoo-only flag is in the Megatron-LM table"
    assert TPZOO_ONLY <= set(parser._option_string_actions), "TPZOO_ONLY names a flag pretrain.py does not have"


def test_every_refused_entry_is_a_refused_row_and_no_real_flag(parser):
    real = {s for a in parser._actions if a.option_strings and type(a).__name__ != "_Refuse" for s in a.option_strings}
    assert not set(REFUSED) & real, f"REFUSED entries shadowed by flags pretrain.py implements: {set(REFUSED) & real}"
    assert not set(REFUSED) - set(REFUSED_ROWS), f"REFUSED entries without a row: {set(REFUSED) - set(REFUSED_ROWS)}"


def test_every_flag_of_the_issue_has_a_row():
    assert not [flag for flag in ISSUE if flag not in ROWS]


def test_ffn_hidden_size_sets_the_mlp_width(parser):
    from tpzoo.training.model_args import ModelChoice, model_config
    config = model_config(ModelChoice.of(vars(parser.parse_args(f"--model {CAUSAL_LM.family} --num-layers 2 "
                                                                "--hidden-size 32 --num-attention-heads 4 "
                                                                "--ffn-hidden-size 48".split()))))
    assert config.ffn_hidden_size == 48, config


def test_exit_signal_handler_installs_the_handler(parser):
    """Megatron-LM's --exit-signal-handler turns on what tpzoo does by default (--no-exit-signal-handler: off)."""
    import torch

    from tpzoo.training.run_config import StoppingConfig, section_of
    from tpzoo.training.stopping import StopRules
    for argv, on in ((["--exit-signal-handler"], True), ([], True), (["--no-exit-signal-handler"], False)):
        rules = StopRules.of(section_of(StoppingConfig, vars(parser.parse_args(argv))), torch.device("cpu"))
        assert (rules.flag is not None) == on, argv
