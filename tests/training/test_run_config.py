"""The run configuration's sections (tpzoo/training/run_config.py): a section is checked field by field when it is
made (ValueError naming the field), takes its fields from the parsed flags, and generates its flag group, whose
values pass the same checks in the flag's words."""

from __future__ import annotations

import argparse

import pytest

from tpzoo.training.args import command_parser
from tpzoo.training.run_config import StoppingConfig, add_section, section_of

pytestmark = pytest.mark.tier("unit")


def parser() -> argparse.ArgumentParser:
    p = command_parser("test", "")
    add_section(p, StoppingConfig, "stopping")
    return p


@pytest.mark.parametrize("changes, message", [
    (dict(exit_interval=0), "StoppingConfig.exit_interval must be >= 1, got 0"),
    (dict(max_skipped_steps="3"), "StoppingConfig.max_skipped_steps must be an int, got str '3'"),
    (dict(exit_duration_in_mins=-1.0), "StoppingConfig.exit_duration_in_mins must be > 0, got -1.0"),
    (dict(exit_signal_handler=1), "StoppingConfig.exit_signal_handler must be True or False, got int 1"),
])
def test_a_section_names_the_field_it_refuses(changes, message):
    with pytest.raises(ValueError, match=message):
        StoppingConfig(**changes)


def test_the_flags_generated_give_the_section():
    args = parser().parse_args("--no-exit-signal-handler --exit-interval 5 --max-skipped-steps 3".split())
    assert section_of(StoppingConfig, {**vars(args), "lr": 1.0}) == StoppingConfig(
        exit_signal_handler=False, exit_interval=5, max_skipped_steps=3)
    assert section_of(StoppingConfig, vars(parser().parse_args([]))) == StoppingConfig()


def test_a_flag_value_out_of_range_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        parser().parse_args(["--exit-interval", "0"])
    assert exit.value.code == 2
    assert "argument --exit-interval: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_help_names_each_flag_its_value_and_meaning():
    text = " ".join(parser().format_help().split())
    assert "--exit-signal-handler, --no-exit-signal-handler on SIGTERM or SIGINT finish the step" in text
    assert "--exit-interval N save and exit 0 after an iteration divisible by N" in text
    assert "--max-skipped-steps N exit 1 after N steps in a row skipped" in text and "(default: 10)" in text
