"""Pretrain a GPT or BERT on the pp x dp x tp mesh: ``python pretrain.py`` (a tiny GPT on the demo
corpus, a few minutes on a CPU) or ``torchrun --nproc-per-node N pretrain.py --tp .. --pp ..``.
Flags, schedule, metrics and checkpoints: docs/training.md."""

from __future__ import annotations

import argparse

import torch.distributed as dist

from tpzoo.data.build import add_data_args
from tpzoo.training.args import (add_model_args, add_optimizer_args, add_parallel_args, add_precision_args,
                                 add_run_args, command_parser, exit_on_misuse)
from tpzoo.training.loop import Summary, train
from tpzoo.training.setup import build_run

PROG = "pretrain.py"


def parser() -> argparse.ArgumentParser:
    p = command_parser(PROG, "Pretrain a GPT or BERT on the pp x dp x tp mesh (docs/training.md).")
    add_model_args(p)
    add_parallel_args(p)
    add_optimizer_args(p, train_iters=300, lr=3e-3, min_lr=3e-4, lr_warmup_iters=30)
    add_precision_args(p)
    add_data_args(p)
    add_run_args(p)
    return p


def main() -> Summary:
    args = parser().parse_args()
    summary = train(exit_on_misuse(PROG, lambda: build_run(args)))
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
