"""python -m tpzoo.convert: Hugging Face folders <-> tpzoo model folders, in one process, no GPU.

    python -m tpzoo.convert from-hf HF_DIR OUT_DIR     # a Hugging Face folder (safetensors) -> tpzoo
    python -m tpzoo.convert to-hf TPZOO_DIR OUT_DIR    # tpzoo -> a folder from_pretrained opens

A tpzoo model folder holds the full weights, so it loads at any tensor-parallel size
(``tpzoo.models.pretrained.from_pretrained``). to-hf also takes a training checkpoint (a ``--save``
dir or an iter_NNNNNNN folder, any mesh): it is loaded whole at tp=1 in this process. The tokenizer goes
along both ways (``tokenizer_files``). Misuse exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

from torch import Tensor

from tpzoo.convert.hf import hf_to_tpzoo, read_hf, tpzoo_to_hf, write_hf
from tpzoo.convert.mapping import ConversionError, architectures
from tpzoo.convert.peft_adapters import write_peft
from tpzoo.convert.tokenizer_files import copy_tokenizer_files
from tpzoo.lora_options import LoRAConfig
from tpzoo.models.hf_rules import is_classifier
from tpzoo.models.family_flag import add_model_flag
from tpzoo.models.config import ModelConfig
from tpzoo.models.pretrained import CONFIG_FILE, model_options, read_pretrained, write_pretrained
from tpzoo.parallel.lora import merge_adapters, without_adapters


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
        if name == "to-hf":
            p.add_argument("--peft", metavar="ADAPTER_DIR", type=Path, default=None,
                           help="a LoRA checkpoint's adapters unmerged: the base weights to OUT_DIR, the adapters "
                                "as a PEFT adapter folder ADAPTER_DIR (default: merged into the weights)")
            p.add_argument("--tokenizer-model", metavar="PATH", default=None,
                           help="the tokenizer to write beside the weights (default: the one the checkpoint records "
                                "or the folder holds)")
    return parser


def read_training_checkpoint(path: Path) -> tuple[str, dict[str, Any], ModelConfig, dict[str, Tensor], LoRAConfig]:
    """(class name, options, config, full state dict, its LoRA adapters' config) of a training checkpoint, like
    ``read_pretrained``: the whole model loaded at tp=1 in this process (a one-rank process group, closed again)."""
    import torch.distributed as dist

    from tpzoo.checkpoint import load_model, resolve_checkpoint
    from tpzoo.models.sharding import full_state_dict
    from tpzoo.parallel import init_mesh
    from tpzoo.parallel.lora import recorded_adapters

    folder = resolve_checkpoint(path)  # before starting a process group: a wrong path fails fast
    try:
        model = load_model(folder, init_mesh(device_type="cpu"))
        lora = recorded_adapters(model.adapters)[0] if getattr(model, "adapters", None) else LoRAConfig()
        return type(model).__name__, model_options(model), model.config, full_state_dict(model), lora
    finally:
        dist.destroy_process_group()


def read_model(path: Path) -> tuple[str, dict[str, Any], ModelConfig, dict[str, Tensor], LoRAConfig]:
    """``read_training_checkpoint`` of a training checkpoint, ``read_pretrained`` of a model folder (no adapters)."""
    if (path / CONFIG_FILE).is_file():
        return (*read_pretrained(path), LoRAConfig())
    return read_training_checkpoint(path)


def label_names(path: Path) -> list[str] | None:
    """The class names a finetune.py checkpoint records (its ``label_names``), or None."""
    from tpzoo.checkpoint import read_meta

    return None if (path / CONFIG_FILE).is_file() else read_meta(path).get("label_names")


def has_adapters(path: Path) -> bool:
    """Whether the training checkpoint at ``path`` holds LoRA adapters (a model folder holds none)."""
    from tpzoo.checkpoint import read_meta

    return not (path / CONFIG_FILE).is_file() and bool(read_meta(path)["checkpoint"]["model"].get("adapters"))


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


def write_tokenizer(source: Path, out: Path, tokenizer_model: str | None, config: ModelConfig) -> str:
    """Write the tokenizer of the model at ``source`` (or ``tokenizer_model``) into the Hugging Face folder
    ``out``; what to say of it. ValueError when its vocabulary is larger than the model's."""
    from tpzoo.checkpoint.tokenizer import model_tokenizer
    from tpzoo.convert.tokenizer_files import write_hf_tokenizer

    try:
        tokenizer = model_tokenizer(source, tokenizer_model)
    except (ValueError, FileNotFoundError) as e:
        return f"no tokenizer ({e})"
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model's "
                         f"vocabulary has {config.vocab_size}; pass the --tokenizer-model the model was trained with")
    try:
        files = write_hf_tokenizer(tokenizer, out, config.max_position_embeddings)
    except TypeError as e:
        return f"no tokenizer ({e})"
    return f"its tokenizer ({', '.join(files)})"


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"python -m tpzoo.convert: error: {message}\n")
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.source.is_dir():
        _fail(f"{args.source} is not a folder; pass the folder that holds config.json and the weights")
    for folder in (args.out, getattr(args, "peft", None)):
        if folder and folder.exists() and (not folder.is_dir() or any(folder.iterdir())) and not args.overwrite:
            _fail(f"{folder} already exists and is not empty; choose a new folder or pass --overwrite")
    try:
        if getattr(args, "peft", None) and not has_adapters(args.source):
            _fail(f"{args.source} holds no LoRA adapters; --peft writes a LoRA fine-tuning's adapters: drop it")
        if args.direction == "from-hf":
            class_name, options, config, state = hf_to_tpzoo(*read_hf(args.source))
            write_pretrained(args.out, class_name, options, config, state)
            files = copy_tokenizer_files(args.source, args.out)
            what = f"tpzoo {class_name}"
            tokenizer = f"its tokenizer ({', '.join(files)})" if files else f"no tokenizer ({args.source} holds none)"
        else:
            class_name, options, config, state, lora = read_model(args.source)
            if args.peft:  # the base weights to OUT_DIR, the adapters beside them for PEFT
                write_peft(args.peft, args.out, class_name, options, config, state, lora)
            weights = merge_adapters(state, lora) if lora.enabled and not args.peft else state  # W + (alpha / r) B A
            hf_config, hf_state, tied = tpzoo_to_hf(class_name, options, config, without_adapters(weights))
            names = label_names(args.source)
            if names and len(names) == getattr(hf_config, "num_labels", None):  # the classes, not LABEL_0 ...
                hf_config.id2label = dict(enumerate(names))
                hf_config.label2id = {name: i for i, name in enumerate(names)}
            if is_classifier(hf_config.architectures[0]) and getattr(hf_config, "pad_token_id", None) is None:
                hf_config.pad_token_id = padding_id(args.source)  # where a decoder classifier finds the last token
            write_hf(args.out, hf_config, hf_state, tied)
            tokenizer = write_tokenizer(args.source, args.out, args.tokenizer_model, config)
            what = f"Hugging Face {hf_config.architectures[0]}"
    except (ConversionError, FileNotFoundError, ValueError, KeyError) as e:
        _fail(str(e).strip("'\""))
    params = sum(t.numel() for t in without_adapters(state).values())
    if getattr(args, "peft", None):
        tokenizer += f"; the LoRA adapters as a PEFT folder in {args.peft}"
    print(f"wrote {what} ({params:,} parameters, {config.num_layers} layers, "
          f"hidden {config.hidden_size}) to {args.out}, with {tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
