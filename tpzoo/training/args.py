"""The flags ``pretrain.py`` and ``finetune.py`` share (Megatron-LM's names, ``shared/CONTRACT.md``
section 1), and what they turn into: the model config (what the model is), the ``ParallelPlan`` (how it
runs: mesh, sequence parallelism, recompute, kernels, compile, seed) and the ``EngineConfig``.

    parser = command_parser("pretrain.py", "Pretrain a model on the pp x dp x tp mesh.")
    add_model_args(parser); add_parallel_args(parser); add_precision_args(parser)
    add_optimizer_args(parser)                        # tpzoo.training.optimizer_args: batch, schedule, optimizer
    args = parser.parse_args()
    config = model_config(args)                       # the preset, overridden by the model flags given
    plan = plan_from_args(args, init_mesh(args.tp, args.pp, args.dp))
    engine = engine_config(args)                      # batch, schedule, optimizer, precision

``--model`` names a family of ``tpzoo.models.families`` and ``--preset`` any family's preset. Flags a
script does not want to default are None until given; ``model_config`` applies only those given.
This module imports without torch. Misuse leaves through ``exit_on_misuse``: one line on stderr,
exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from tpzoo.engine.config import SCHEDULES, EngineConfig
from tpzoo.flag_types import non_negative_int, positive_float, positive_int, probability
from tpzoo.models.config import ModelConfig, field_names
from tpzoo.models.families import FAMILIES, PRESETS, family
from tpzoo.models.family_flag import add_model_flag
from tpzoo.models.presets import get_preset
from tpzoo.run_options import ATTENTION_BACKENDS, KERNEL_BACKENDS

if TYPE_CHECKING:
    from tpzoo.parallel import ParallelMesh, ParallelPlan

MISUSE = (ValueError, TypeError, FileNotFoundError, KeyError)
# the dynamic fp16 loss scale's flags when not given: Megatron's, but for the initial scale, 2^16
# (torch's GradScaler's) instead of Megatron's 2^32: fp16's largest number is 65504, so a larger start
# only skips the first steps (17 from 2^32 at hysteresis 2) on overflows that halve it down
LOSS_SCALE_DEFAULTS = dict(initial_loss_scale=2.0**16, min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2)
LOSS_SCALE_FLAGS = ("loss_scale", *LOSS_SCALE_DEFAULTS)
# Megatron-LM's recompute flags (tpzoo.training.architecture_args), the plan's options of their names
RECOMPUTE_FLAGS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


class DefaultsOnceFormatter(argparse.HelpFormatter):
    """Help that states each flag's default once: appended as ``(default: X)`` unless the help text
    already says it; nothing for defaults that mean "not given" (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit status 2, and whose
    --help gives every flag's default once."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def format_help(self) -> str:
        for action in self._actions:  # argparse prints no help line at all for a flag without help text
            if action.help is None and action.default not in (None, False, argparse.SUPPRESS):
                action.help = "default: %(default)s"
        return super().format_help()

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        """argparse's, with ``--config FILE`` (where the parser has it) replaced by the file's flags, put first."""
        if "config" in {a.dest for a in self._actions}:
            from tpzoo.training.config_file import expand_config

            try:
                args = expand_config(self, list(sys.argv[1:] if args is None else args))
            except ValueError as e:
                self.error(str(e))
        return super().parse_known_args(args, namespace)

    def given(self, argv: list[str] | None = None) -> set[str]:
        """The destinations of the flags written on the command line (``argv``, default sys.argv),
        as opposed to those left at their defaults."""
        return set(vars(self.parse_args(argv, Unfilled())))


class Unfilled(argparse.Namespace):
    """A namespace that claims to hold every attribute, so argparse fills in no defaults and only the
    flags actually given land in it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return None


def command_parser(prog: str, description: str) -> CommandParser:
    return CommandParser(prog=prog, description=description, formatter_class=DefaultsOnceFormatter)


def exit_on_misuse(prog: str, main: Callable[[], Any]) -> Any:
    """Run ``main``; a ValueError/TypeError/FileNotFoundError/KeyError (bad input) becomes
    ``prog: error: <message>`` on stderr and exit status 2, without a traceback."""
    try:
        return main()
    except MISUSE as err:
        _exit(prog, " ".join(str(err.args[0] if isinstance(err, KeyError) and err.args else err).split()), 2)


def exit_on_run_error(prog: str, main: Callable[[], Any]) -> Any:
    """Run ``main`` (the training loop); what stops it for a reason the user can fix becomes ``prog: error:
    <message>`` on rank 0's stderr, on every rank: a checkpoint that cannot be written (``CheckpointWriteError``:
    disk full, no permission; exit status 1, latest unchanged), or a sharding plan that misdescribes a
    parameter, found on the first step before any update (``PlanError``; exit status 2)."""
    from tpzoo.checkpoint.save import CheckpointWriteError  # torch: imported once the flags are checked
    from tpzoo.engine.replicas import PlanError

    try:
        return main()
    except CheckpointWriteError as err:
        _exit(prog, str(err), 1)
    except PlanError as err:
        _exit(prog, str(err), 2)


def _exit(prog: str, message: str, status: int) -> NoReturn:
    """``prog: error: <message>`` on stderr (rank 0 only: under torchrun every rank fails alike, one line
    is enough) and exit ``status``, without a traceback."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(status) from None


def check_output_folder(flag: str, path: str | os.PathLike | None) -> None:
    """ValueError naming ``flag`` when the folder ``path`` cannot be made because it, or a folder
    above it, is a file (checked before anything heavy runs; None = not given)."""
    if path is None:
        return
    for p in (Path(path), *Path(path).absolute().parents):
        try:
            exists, is_dir = p.exists(), p.is_dir()
        except OSError as e:  # a folder above it that may not be read
            raise ValueError(f"{flag} {path}: cannot look at {p} ({e.strerror or e}); choose another path") from None
        if exists:
            if not is_dir:
                where = "" if p == Path(path) else f": {p}"
                raise ValueError(f"{flag} {path}{where} is a file, not a folder; choose another path")
            return


def check_preset(args: argparse.Namespace) -> None:
    """ValueError unless ``--preset`` (if given) is a preset of a registered family."""
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"--preset {args.preset}: unknown preset; choose one of {', '.join(PRESETS)}")


def model_flag_fields() -> dict[str, dataclasses.Field]:
    """The config fields, of every registered family's config, that a flag of their own name sets (``--num-layers``:
    ``num_layers``; ``ModelConfig.flag_fields``): the flags that override a preset's value."""
    out = dict(ModelConfig.flag_fields())
    for f in FAMILIES.values():
        out.update({k: v for k, v in f.config_class.flag_fields().items() if k not in out})
    return out


def config_flag(group: argparse._ArgumentGroup, name: str, help: str = "default: the preset's") -> None:
    """Add config field ``name``'s flag to ``group``: its name, value type and meaning as the field declares them
    (``tpzoo.models.config``), None until given."""
    f = model_flag_fields()[name]
    group.add_argument(f.metadata["flag"], type=f.metadata["check"].parse, help=f"{f.metadata['doc']} ({help})")


def add_model_args(parser: argparse.ArgumentParser, default_model: str = "gpt") -> None:
    """``--model --preset`` and the shape flags that override the preset (None = the preset's). ``--model``
    stays None until given: ``tpzoo.training.architecture_args.resolve_architecture`` sets it (the family
    the architecture flags describe, ``default_model`` first when several do)."""
    g = parser.add_argument_group("model")
    add_model_flag(g, metavar="FAMILY", help=f"the model family: {', '.join(FAMILIES)}, or module:NAME, a "
                   f"tpzoo.models.Family of your own (docs/new-model.md) (default: the one Megatron-LM's architecture "
                   f"flags describe, {default_model} without them)")
    parser.set_defaults(default_model=default_model)
    defaults = ", ".join(f.default_preset for f in FAMILIES.values())
    g.add_argument("--preset", metavar="NAME", help=f"model shape, a preset of the --model family: "
                   f"{', '.join(PRESETS)} (default: the family's {defaults})")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                 "max_position_embeddings", "hidden_dropout", "attention_dropout"):
        config_flag(g, name)
    g.add_argument("--seq-length", type=positive_int, default=64, help="tokens per training sequence")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Mesh sizes (``tp x pp x dp`` = world size; dp inferred when omitted) and the parallel options."""
    g = parser.add_argument_group("parallel")
    g.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=positive_int, default=1)
    g.add_argument("--data-parallel-size", "--dp", dest="dp", type=positive_int,
                   help="default: world size / (tp x pp)")
    g.add_argument("--virtual-pipeline-model-parallel-size", "--vpp", dest="vpp", type=positive_int,
                   help="model chunks per pp rank (interleaved schedules; default: 2 for them)")
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default="1f1b")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="ZeRO-2 over dp: optimizer state and "
                   "main weights sharded, gradients reduce-scattered to their owner")
    g.add_argument("--use-torch-fsdp2", action="store_true", help="weights, gradients and optimizer state sharded "
                   "over dp by torch's FSDP2 (ZeRO-3), each layer gathered for its forward and backward; needs dp > 1")
    g.add_argument("--distributed-timeout-minutes", type=positive_float, default=10.0,
                   help="a collective waiting this long on a peer fails; every rank then exits naming the stuck "
                   "or dead ones")
    g.add_argument("--local-rank", type=non_negative_int, help="this process's rank on its node, as "
                   "torch.distributed.launch passes it (torchrun sets LOCAL_RANK instead); must agree with LOCAL_RANK")


def set_model_defaults(parser: argparse.ArgumentParser, defaults: Mapping[str, dict[str, Any]]) -> None:
    """Make the flags of ``defaults`` (per ``--model``: {dest: value}) None until given, their help
    naming each model's value; ``fill_model_defaults`` fills them in once the model is known."""
    names = set().union(*defaults.values())
    for action in parser._actions:
        if action.dest in names:
            action.default = None
            by_model = ", ".join(f"{model} {values[action.dest]:g}" for model, values in defaults.items())
            action.help = "; ".join(filter(None, [action.help, f"default: {by_model}"]))


def fill_model_defaults(args: argparse.Namespace, defaults: Mapping[str, dict[str, Any]]) -> argparse.Namespace:
    """Set each flag of ``defaults[args.model]`` that is None (not given) to the model's default."""
    unknown = sorted(set(defaults[args.model]) - set(vars(args)))
    if unknown:
        raise ValueError(f"the train_defaults of model {args.model!r} name {', '.join(unknown)}, which are no flags "
                         f"of this command; use the flags' destinations (e.g. train_iters, lr, min_lr)")
    for name, value in defaults[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def add_precision_args(parser: argparse.ArgumentParser) -> None:
    """--bf16/--fp16, fp16's loss scale (Megatron's flags; None until given: ``engine_config`` refuses
    them without --fp16 and fills in ``LOSS_SCALE_DEFAULTS``) and the speed options."""
    g = parser.add_argument_group("precision and speed")
    dtype = g.add_mutually_exclusive_group()
    dtype.add_argument("--bf16", action="store_true", help="bf16 weights and grads, fp32 main weights")
    dtype.add_argument("--fp16", action="store_true", help="fp16 weights and grads, fp32 main weights, loss scaling")
    g.add_argument("--loss-scale", type=positive_float, help="fp16: a static loss scale (an overflow still skips "
                   "its step); default: dynamic, the flags below")
    g.add_argument("--initial-loss-scale", type=positive_float, help="fp16: the dynamic loss scale to start from "
                   f"(default: {LOSS_SCALE_DEFAULTS['initial_loss_scale']:g})")
    g.add_argument("--min-loss-scale", type=positive_float, help="fp16: the dynamic scale never backs off below "
                   f"this (default: {LOSS_SCALE_DEFAULTS['min_loss_scale']:g})")
    g.add_argument("--loss-scale-window", type=positive_int, help="fp16: clean steps in a row before the scale "
                   f"doubles (default: {LOSS_SCALE_DEFAULTS['loss_scale_window']})")
    g.add_argument("--hysteresis", type=positive_int, help="fp16: overflows since the scale last grew before it "
                   f"halves (default: {LOSS_SCALE_DEFAULTS['hysteresis']})")
    g.add_argument("--recompute-activations", action="store_true", help="recompute each layer in backward")
    g.add_argument("--kernels", choices=KERNEL_BACKENDS, default="auto")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    g.add_argument("--compile", action="store_true", help="torch.compile each layer and the loss head (backend: "
                   "$TPZOO_COMPILE_BACKEND, inductor if unset; docs/training.md); off unless given: its speed-up "
                   "is not yet measured on a GPU")


def model_config(args: argparse.Namespace, base: ModelConfig | None = None, **changes: Any) -> ModelConfig:
    """``base`` (default: ``--preset``, else the ``--model`` family's default preset) with the model
    flags given and ``changes`` applied. A flag the family's config has no field for is a ValueError."""
    fam = family(args.model)
    if base is None:
        base = get_preset(args.preset or fam.default_preset)
    if base.model_type != fam.name:
        raise ValueError(f"--preset {args.preset} is a {base.model_type} model but --model is {args.model}; "
                         f"drop one of them or make them agree")
    given = {name: getattr(args, name) for name in model_flag_fields() if getattr(args, name, None) is not None}
    foreign = [name for name in given if name not in field_names(type(base))]
    if foreign:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in foreign)
        raise ValueError(f"{flags} does not apply to --model {base.model_type} (its {type(base).__name__} has no "
                         f"{', '.join(foreign)}); drop it")
    config = base.replace(**given, **changes)
    if args.seq_length > config.max_position_embeddings:
        raise ValueError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                         f"{config.max_position_embeddings}; lower the first or raise the second")
    return config


def plan_from_args(args: argparse.Namespace, mesh: ParallelMesh) -> ParallelPlan:
    """The ``ParallelPlan`` of ``mesh`` and the run option flags: --sequence-parallel,
    --recompute-activations, --kernels, --attention-backend, --compile, --use-torch-fsdp2 (``fsdp``),
    --seed (the weights' seed) and Megatron-LM's --recompute-granularity/-method/-num-layers when present.
    --compile where torch.compile cannot run here (``tpzoo.models.compile.compile_problem``) is a ValueError."""
    from tpzoo.parallel import ParallelPlan

    if args.compile:
        from tpzoo.models.compile import compile_problem

        problem = compile_problem(mesh.device)
        if problem:
            raise ValueError(f"--compile: {problem}")
    return ParallelPlan(mesh, sequence_parallel=args.sequence_parallel,
                        recompute_activations=args.recompute_activations, kernels=args.kernels,
                        attention_backend=args.attention_backend, seed=args.seed, compile=args.compile,
                        fsdp=args.use_torch_fsdp2, **{name: getattr(args, name, None) for name in RECOMPUTE_FLAGS})


def check_local_rank(args: argparse.Namespace) -> None:
    """--local-rank (torch.distributed.launch's): the device index of this process, which tpzoo reads from
    LOCAL_RANK; set there when the launcher did not, a ValueError naming both when they differ."""
    if args.local_rank is None:
        return
    launcher = os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    if int(launcher) != args.local_rank:
        raise ValueError(f"--local-rank {args.local_rank} differs from the launcher's LOCAL_RANK {launcher}; "
                         f"drop --local-rank (torchrun sets LOCAL_RANK)")


def check_fsdp_flags(args: argparse.Namespace) -> None:
    """--use-torch-fsdp2's misuse, from the flags and torchrun's WORLD_SIZE alone (before torch loads; the
    engine's ``tpzoo.engine.fsdp_params.check_fsdp`` says why): a ValueError naming the fix with
    --use-distributed-optimizer (FSDP shards the optimizer state already; Megatron refuses the pair too),
    with the interleaved-zero-bubble schedule at pp > 1, and when dp is 1 (nothing to shard over). Sizes
    that do not divide the world size are left to ``init_mesh``, which names them."""
    if not args.use_torch_fsdp2:
        return
    if args.use_distributed_optimizer:
        raise ValueError("--use-torch-fsdp2 already shards the optimizer state over dp; drop "
                         "--use-distributed-optimizer or --use-torch-fsdp2")
    if args.pp > 1 and args.pipeline_schedule == "interleaved-zero-bubble":
        raise ValueError(f"--use-torch-fsdp2 cannot run --pipeline-schedule interleaved-zero-bubble at pp {args.pp} "
                         f"(its split weight gradients miss FSDP's gathered weights); use interleaved-1f1b or drop "
                         f"--use-torch-fsdp2")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = args.dp or world // (args.tp * args.pp)
    if dp == 1:
        raise ValueError(f"--use-torch-fsdp2 shards over dp, but dp is 1 (world size {world}, tp {args.tp}, "
                         f"pp {args.pp}): nothing to shard over; drop --use-torch-fsdp2 or launch more ranks")


def engine_config(args: argparse.Namespace, **changes: Any) -> EngineConfig:
    """The ``EngineConfig`` of the batch, parallel, optimizer and precision flags (and ``changes``)."""
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    scaling = {name: getattr(args, name) for name in LOSS_SCALE_FLAGS
               if getattr(args, name, None) is not None}
    if scaling and precision != "fp16":
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in scaling)
        raise ValueError(f"{flags} set the fp16 loss scale, but this run is {precision}; add --fp16 or drop them")
    return EngineConfig(**{
        **dict(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
               schedule=args.pipeline_schedule, virtual_stages=args.vpp,
               use_distributed_optimizer=args.use_distributed_optimizer, lr=args.lr,
               weight_decay=args.weight_decay, clip_grad=args.clip_grad, precision=precision,
               optimizer=args.optimizer, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
               adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum,
               timeout_s=60.0 * args.distributed_timeout_minutes),
        **(dict(LOSS_SCALE_DEFAULTS, **scaling) if precision == "fp16" else {}),
        **changes})


def process_timeout(args: argparse.Namespace) -> timedelta:
    """--distributed-timeout-minutes: the timeout of every process group (``init_mesh(timeout=)``)."""
    return timedelta(minutes=args.distributed_timeout_minutes)


def add_run_args(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Checkpointing, evaluation and logging: ``--save --save-interval --load --eval-interval
    --eval-iters --log-interval --log-dir`` (``defaults`` override the values below), and the
    stopping flags (``add_stopping_args``)."""
    d = {**dict(save_interval=None, eval_interval=50, eval_iters=4, log_interval=10), **defaults}
    g = parser.add_argument_group("run")
    g.add_argument("--save", metavar="DIR", help="checkpoint folder (default: runs/<model>-<time>)")
    g.add_argument("--save-interval", "--persistent-save-interval", type=positive_int, default=d["save_interval"],
                   help="save every N iterations (default: only at the end)")
    g.add_argument("--load", metavar="DIR", help="resume the run saved in DIR (its newest checkpoint, or DIR/iter_N) "
                   "as it was configured; flags given change only what they name")
    g.add_argument("--eval-interval", type=non_negative_int, default=d["eval_interval"],
                   help="validation loss every N iterations and at the end; 0 = never")
    g.add_argument("--eval-iters", type=positive_int, default=d["eval_iters"], help="global batches per evaluation")
    g.add_argument("--log-interval", type=positive_int, default=d["log_interval"], help="log every N iterations")
    g.add_argument("--log-dir", metavar="DIR", help="metrics.jsonl and TensorBoard events (default: the --save dir)")
    add_stopping_args(parser)


def add_stopping_args(parser: argparse.ArgumentParser) -> None:
    """When a run stops early: the flags of ``tpzoo.training.run_config.StoppingConfig``."""
    from tpzoo.training.run_config import StoppingConfig, add_section

    add_section(parser, StoppingConfig, "stopping")
