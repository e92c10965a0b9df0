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


def test_the_resume_rules_derive_from_the_sections_roles():
    """A resume's lists of flags are the sections' roles, no longer kept by hand: they equal the lists written
    out before the sections existed (the launch's flags, those given together, what the run trains on)."""
    from tpzoo.training.resolve import GIVEN_TOGETHER, LAUNCH_FLAGS, MEANING_FLAGS, PATH_FLAGS

    splits = ("train_data_path", "valid_data_path", "test_data_path")
    fusions = ("masked_softmax", "bias_gelu", "bias_swiglu", "bias_dropout", "rope", "gradient_accumulation")
    assert LAUNCH_FLAGS == {
        "tp", "pp", "dp", "cp", "cp_comm_type", "ep", "vpp", "pipeline_schedule", "sequence_parallel", "use_distributed_optimizer",
        "use_torch_fsdp2", "recompute_activations", "kernels", "attention_backend", "compile", "load", "save",
        "distributed_timeout_minutes", "exit_signal_handler", "exit_interval", "exit_duration_in_mins",
        "max_skipped_steps", "timing_log_level", "timing_log_option", "tensorboard_queue_size", "default_model",
        "num_workers", "local_rank", "use_flash_attn", "overlap_grad_reduce", "overlap_param_gather",
        "recompute_granularity", "recompute_method", "recompute_num_layers", "no_persist_layer_norm",
        "attention_softmax_in_fp32", *(f"no_{name}_fusion" for name in fusions), "finetune", "no_load_optim",
        "no_load_rng", "no_save_optim", "no_save_rng", "use_checkpoint_args", "exit_on_missing_checkpoint",
        "moe_grouped_gemm", "moe_token_dispatcher_type", "elastic", "async_save", "log_straggler",
        "num_distributed_optimizer_instances", "fault_tolerance", "ft_replica_id", "ft_replica_groups",
        "ft_min_replicas"}
    sources, parts = {"data_path", "dataset", "mock_data", *splits}, {"dataset_config", "dataset_split", "json_key"}
    tokenizer = {"tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size", "null_tokenizer_eod_id",
                 "null_tokenizer_pad_id"}
    samples = {"train_samples", "lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"}
    iters = {"train_iters", "lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters"}
    loss_scale = {"loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"}
    assert GIVEN_TOGETHER == {
        "bf16": {"fp16", *loss_scale}, "fp16": {"bf16"},
        **{s: (sources - {s}) | tokenizer | parts for s in sources}, **{t: tokenizer - {t} for t in tokenizer},
        **{name: samples for name in iters}, **{name: iters for name in samples},
        "lr_warmup_iters": samples | {"lr_warmup_fraction"}, "lr_warmup_samples": iters | {"lr_warmup_fraction"},
        "lr_warmup_fraction": {"lr_warmup_iters", "lr_warmup_samples"},
        "rampup_batch_size": {"step_batch_size_schedule"}, "step_batch_size_schedule": {"rampup_batch_size"},
        "weight_decay_incr_style": {"start_weight_decay", "end_weight_decay"}}
    assert MEANING_FLAGS[0] == "seq_length" and set(MEANING_FLAGS) == {
        "seq_length", "bert_no_binary_head", *sources, *parts, *tokenizer, "split", "mask_prob", "seed",
        "reset_position_ids", "reset_attention_mask", "eod_mask_loss"}
    assert set(PATH_FLAGS) == {"data_path", *splits, "tokenizer_model", "vocab_file", "merge_file", "data_cache_path",
                               "log_dir", "tensorboard_dir", "wandb_save_dir"}


def test_the_docs_example_of_the_run_configuration_runs():
    """docs/config.md's code: a RunConfig made of flags, its sections typed and checked."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1 and "RunConfig.of" in blocks[0]
    exec(compile(blocks[0], "docs/config.md", "exec"), {})
