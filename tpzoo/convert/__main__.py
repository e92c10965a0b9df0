"""python -m tpzoo.convert: Hugging Face folders <-> tpzoo model folders, in one process, no GPU.

    python -m tpzoo.convert from-hf HF_DIR OUT_DIR     # a Hugging Face folder (safetensors) -> tpzoo
    python -m tpzoo.convert to-hf TPZOO_DIR OUT_DIR    # tpzoo -> a folder from_pretrained opens

A tpzoo model folder holds the full weights, so it loads at any tensor-parallel size
(``tpzoo.models.pretrained.from_pretrained``). to-hf also takes a training checkpoint (a ``--save``
dir or an iter_NNNNNNN folder, any mesh): it is loaded whole at tp=1 in this process. Misuse exits
with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

from torch import Tensor

from tpzoo.convert.hf import hf_to_tpzoo, read_hf, tpzoo_to_hf, write_hf
from tpzoo.convert.mapping import ConversionError, architectures
from tpzoo.models.hf_rules import is_classifier
from tpzoo.models.family_flag import add_model_flag
from tpzoo.models.config import ModelConfig
from tpzoo.models.pretrained import CONFIG_FILE, model_options, read_pretrained, write_pretrained


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m tpzoo.convert", description=__doc__.split("\n\n")[0],
                     epilog=f"Hugging Face architectures: {', '.join(architectures())}.")
    sub = parser.add_subparsers(dest="direction", required=True, metavar="{from-hf,to-hf}", parser_class=_Parser)
    for name, src, what in (("from-hf", "HF_DIR", "Hugging Face folder (config.json + model.safetensors) -> "
                             "tpzoo model folder"),
                            ("to-hf", "TPZOO_DIR", "tpzoo model folder or training checkpoint -> Hugging Face "
                             "folder")):
        p = sub.add_parser(name, help=what, description=what)
        p.add_argument("source", metavar=src, type=Path, help="folder to read")
        p.add_argument("out", metavar="OUT_DIR", type=Path, help="folder to write (new or empty)")
        p.add_argument("--overwrite", action="store_true", help="write into OUT_DIR even if it holds files")
        add_model_flag(p)
    return parser


def read_training_checkpoint(path: Path) -> tuple[str, dict[str, Any], ModelConfig, dict[str, Tensor]]:
    """(class name, options, config, full state dict) of a training checkpoint, like ``read_pretrained``:
    the whole model loaded at tp=1 in this process (a one-rank process group, closed again)."""
    import torch.distributed as dist

    from tpzoo.checkpoint import load_model, resolve_checkpoint
    from tpzoo.models.sharding import full_state_dict
    from tpzoo.parallel import init_mesh
    from tpzoo.parallel.lora import merge_adapters, recorded_adapters

    folder = resolve_checkpoint(path)  # before starting a process group: a wrong path fails fast
    try:
        model = load_model(folder, init_mesh(device_type="cpu"))
        state = full_state_dict(model)
        if getattr(model, "adapters", None):  # LoRA: merged into the weights, W + (alpha / r) B A
            state = merge_adapters(state, recorded_adapters(model.adapters)[0])
        return type(model).__name__, model_options(model), model.config, state
    finally:
        dist.destroy_process_group()


def label_names(path: Path) -> list[str] | None:
    """The class names a finetune.py checkpoint records (its ``label_names``), or None."""
    from tpzoo.checkpoint import read_meta

    return None if (path / CONFIG_FILE).is_file() else read_meta(path).get("label_names")


def padding_id(path: Path) -> int | None:
    """The id a finetune.py classifier padded its samples with (``tpzoo.data.tasks.padding_token`` of the recorded
    tokenizer), or None without a tokenizer on this machine."""
    from tpzoo.checkpoint import read_meta
    from tpzoo.data.tasks import padding_token
    from tpzoo.data.tokenizer import recorded_tokenizer

    if (path / CONFIG_FILE).is_file():
        return None
    tokenizer = recorded_tokenizer(read_meta(path).get("tokenizer"))
    return None if tokenizer is None else padding_token(tokenizer)


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"python -m tpzoo.convert: error: {message}\n")
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.source.is_dir():
        _fail(f"{args.source} is not a folder; pass the folder that holds config.json and the weights")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())) and not args.overwrite:
        _fail(f"{args.out} already exists and is not empty; choose a new folder or pass --overwrite")
    try:
        if args.direction == "from-hf":
            class_name, options, config, state = hf_to_tpzoo(*read_hf(args.source))
            write_pretrained(args.out, class_name, options, config, state)
            what = f"tpzoo {class_name}"
        else:
            read = read_pretrained if (args.source / CONFIG_FILE).is_file() else read_training_checkpoint
            class_name, options, config, state = read(args.source)
            hf_config, hf_state, tied = tpzoo_to_hf(class_name, options, config, state)
            names = label_names(args.source)
            if names and len(names) == getattr(hf_config, "num_labels", None):  # the classes, not LABEL_0 ...
                hf_config.id2label = dict(enumerate(names))
                hf_config.label2id = {name: i for i, name in enumerate(names)}
            if is_classifier(hf_config.architectures[0]) and getattr(hf_config, "pad_token_id", None) is None:
                hf_config.pad_token_id = padding_id(args.source)  # where a decoder classifier finds the last token
            write_hf(args.out, hf_config, hf_state, tied)
            what = f"Hugging Face {hf_config.architectures[0]}"
    except (ConversionError, FileNotFoundError, ValueError, KeyError) as e:
        _fail(str(e).strip("'\""))
    params = sum(t.numel() for t in state.values())
    print(f"wrote {what} ({params:,} parameters, {config.num_layers} layers, "
          f"hidden {config.hidden_size}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
