"""Fine-tune a pretrained tpzoo checkpoint (or a converted Hugging Face model) on the pp x dp x tp
mesh: a BERT becomes a sequence classifier (``--task demo``, a GLUE folder, or csv/tsv/jsonl files),
a GPT or Llama fine-tunes as a causal LM on jsonl text (what a family fine-tunes as: its ``finetune``
in ``tpzoo.models.families``). ``python finetune.py --load CKPT --task demo`` or
``torchrun --nproc-per-node N finetune.py ...``. Flags, data and checkpoints: docs/finetuning.md."""

from __future__ import annotations

import argparse

# light imports only until the flags are checked: a misuse is reported before torch loads
from tpzoo.training.args import (CommandParser, add_parallel_args, add_precision_args, add_stopping_args,
                                 check_output_folder, command_parser, exit_on_misuse, exit_on_run_error)
from tpzoo.training.config_file import add_config_args, to_toml, write_config
from tpzoo.training.finetune_args import FinetuneConfig
from tpzoo.training.optimizer_args import add_optimizer_args
from tpzoo.lora_options import LoRAConfig
from tpzoo.training.run_config import RunConfig, add_section, section_of

PROG = "finetune.py"


def parser() -> CommandParser:
    p = command_parser(PROG, "Fine-tune a BERT classifier or a GPT / Llama causal LM (docs/finetuning.md).")
    add_section(p, FinetuneConfig, "fine-tuning")
    add_section(p, LoRAConfig, "LoRA adapters (docs/finetuning.md)")
    add_parallel_args(p)
    # the defaults are what the recipe on real text found (docs/finetuning.md): many small steps
    add_optimizer_args(p, train_iters=None, global_batch_size=16, micro_batch_size=8, lr=1e-3, lr_warmup_iters=10,
                       lr_decay_style="linear")
    add_precision_args(p)
    add_stopping_args(p)
    add_config_args(p)
    return p


def check_flags(args: argparse.Namespace) -> tuple[RunConfig, FinetuneConfig, LoRAConfig]:
    """What the flags alone can be checked for, before torch loads: each section's fields (--use-torch-fsdp2's
    misuse ...), the launch (--local-rank), the folders written to; the run's configuration and own sections."""
    job, tune = RunConfig.of(vars(args)), section_of(FinetuneConfig, vars(args))
    lora = section_of(LoRAConfig, vars(args))
    if job.parallel.fault_tolerance:
        raise ValueError("--fault-tolerance: finetune.py does not take a peer replica group's state; restart lost "
                         "machines with --elastic --save DIR instead (docs/elastic.md)")
    if job.parallel.elastic and tune.save is None:
        raise ValueError("--elastic: finetune.py resumes a restarted run from its checkpoints; pass --save DIR")
    if job.parallel.elastic and lora.save_adapters_only:
        raise ValueError("--elastic resumes from whole checkpoints, but --save-adapters-only saves the adapters "
                         "alone; drop one of them")
    job.parallel.check_launch()
    if job.parallel.cp > 1:
        raise ValueError(f"--context-parallel-size {job.parallel.cp}: finetune.py trains at cp 1 (its classifiers read "
                         f"whole sequences); split long sequences with pretrain.py --finetune instead")
    check_output_folder("--save", tune.save)
    check_output_folder("--log-dir", tune.log_dir)
    return job, tune, lora


def main(argv: list[str] | None = None):
    p = parser()
    args = p.parse_args(argv)
    job, tune, lora = exit_on_misuse(PROG, lambda: check_flags(args))
    if args.print_config:  # the checkpoint's values (dropout, tokenizer) stay its own: not set here
        print(to_toml(p, vars(args)), end="")
        return None
    import torch.distributed as dist

    from tpzoo.training.finetune_loop import finetune
    from tpzoo.training.finetune_setup import build_finetune

    def run():
        built = build_finetune(job, tune, lora)
        write_config(built.log_dir, to_toml(p, built.flags()))  # the --save folder, else the log folder
        return built

    summary = exit_on_run_error(PROG, lambda: finetune(exit_on_misuse(PROG, run)))
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
