"""Megatron-LM's architecture and speed flags (its names, choices and meanings) on tpzoo's model
families and run options. Imports without torch: misuse is reported before torch loads.

Architecture. A family's config class says what its models are, field by field (the traits of
``tpzoo.models.config.ModelConfig``, narrowed by each family: gpt and bert learned_absolute
positions, LayerNorm, GELU, biases; llama rope, RMSNorm, SwiGLU, no biases, grouped-query attention
where it has ``num_query_groups``). Without ``--model`` the flags pick the family they describe, read
as Megatron-LM reads them (a flag not given has Megatron-LM's default), the script's default family
when several match (gpt and bert do: pretrain.py's gpt, pretrain_bert.py's bert; ``args.default_model``,
``add_model_args``); with ``--model`` the flags given must
agree with it. A combination no family has is refused naming the nearest family and the flags that
differ. The flags that only set config fields: ``--norm-epsilon`` (layernorm_epsilon), ``--rotary-base`` and
``--make-vocab-size-divisible-by`` (declared by those fields, applied by ``tpzoo.training.args.model_config``),
``--untie-embeddings-and-output-weights`` (tie_word_embeddings),
``--group-query-attention`` (num_query_groups: ``--num-query-groups``, Megatron-LM's 1 when not
given). Without ``--model`` the model is the one the flags describe: tied unless untied, one kv head
per head unless grouped; with it, the preset's unless a flag says otherwise.

    resolve_architecture(args)   # sets args.model and args.architecture_changes (config field -> value)

Speed. ``--use-flash-attn`` = ``--attention-backend sdpa``; Megatron-LM's attention backends map onto
tpzoo's (``MEGATRON_ATTENTION_BACKENDS``); ``--recompute-granularity/-method/-num-layers`` go to the
plan (``ParallelPlan.recompute_units``); the ``--no-*-fusion`` flags of tpzoo's kernels mean
``--kernels torch``, those of fusions tpzoo never does are its behaviour already; ``--overlap-grad-reduce``
is tpzoo's behaviour (the data-parallel reduce overlaps backward), ``--overlap-param-gather`` true of
FSDP only (its units gather ahead of their compute).

    resolve_speed(args)          # attention backend and kernels to tpzoo's values; the rest checked
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from tpzoo.fields import add_section, at_least, boolean, one_of, option, optional, parses, positive_number
from tpzoo.flag_types import megatron_window
from tpzoo.models.config import ACTIVATIONS
from tpzoo.models.families import FAMILIES, PRESETS, family
from tpzoo.run_options import MEGATRON_ATTENTION_BACKENDS, recompute_problem
from tpzoo.training.model_args import config_field
from tpzoo.training.parallel_config import KERNEL_FUSIONS, SpeedConfig

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "mrope", "relative", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# what a model is, as Megatron-LM's flags say it: trait -> its value when no flag sets it (Megatron-LM's)
TRAITS: dict[str, Any] = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                              add_bias_linear=True, group_query_attention=False, add_qkv_bias=False,
                              qk_layernorm=False, window_size=None, num_experts=None)


@parses(megatron_window)
def _window(v: Any) -> str | None:
    """A sliding window read from Megatron-LM's LEFT,0 (``tpzoo.flag_types.megatron_window``): LEFT + 1 keys."""
    return at_least(1)(v)


def _trait(doc: str, flag: str, off: tuple[str, str] | None = None) -> Any:
    """A switch that is None until given: ``flag`` sets True, ``off`` (flag, meaning) False."""
    return option(None, optional(boolean), doc, flag, switch=True, off=off)


@dataclass(frozen=True)
class ArchitectureConfig:
    """Megatron-LM's architecture flags; each None until given (``resolve_architecture`` reads them)."""

    position_embedding_type: str | None = option(None, optional(one_of(*POSITION_EMBEDDING_TYPES)), "learned_absolute "
                                                 "(gpt, bert) or rope (llama); the others: no family has them",
                                                 "--position-embedding-type")
    rotary_base: float | None = config_field("rotary_base", "rope families; default: the preset's")
    rotary_percent: float | None = option(None, optional(positive_number), "the share of each head's features "
                                          "rotary positions turn: 1.0, or less for a family whose config has "
                                          "rotary_percent (GPT-NeoX's)", "--rotary-percent")
    normalization: str | None = option(None, optional(one_of(*NORMALIZATIONS)), "LayerNorm (gpt, bert) or RMSNorm "
                                       "(llama)", "--normalization")
    norm_epsilon: float | None = option(None, optional(positive_number), "epsilon of the norms (default: the "
                                        "preset's)", "--norm-epsilon")
    swiglu: bool | None = _trait("SwiGLU MLP (llama)", "--swiglu")
    untie_embeddings_and_output_weights: bool | None = _trait("an output layer of its own",
                                                              "--untie-embeddings-and-output-weights")
    group_query_attention: bool | None = _trait("--num-query-groups kv heads (llama; 1 unless given)",
                                                "--group-query-attention")
    add_bias_linear: bool | None = _trait("biases in the linear layers (gpt, bert)", "--add-bias-linear",
                                          ("--disable-bias-linear", "no biases in the linear layers (llama)"))
    kv_channels: int | None = config_field("kv_channels", "qwen3, llama, mistral; the others: hidden / heads only")
    add_qkv_bias: bool | None = _trait("biases on q, k and v (qwen2)", "--add-qkv-bias")
    qk_layernorm: bool | None = _trait("RMSNorm on each head's queries and keys (qwen3)", "--qk-layernorm")
    window_size: int | None = option(None, optional(_window), "sliding-window attention (mistral), Megatron-LM's "
                                     "LEFT,0: each token sees itself and the LEFT tokens before it", "--window-size",
                                     "LEFT,0")
    use_rope_scaling: bool | None = _trait("Llama 3.x's scaled rotary frequencies (the rope families)",
                                           "--use-rope-scaling")
    rope_scaling_factor: float | None = config_field("rope_scaling_factor", "with --use-rope-scaling; default 8.0")
    make_vocab_size_divisible_by: int | None = config_field("make_vocab_size_divisible_by",
                                                             "default: the preset's, 128")
    attention_softmax_in_fp32: bool = option(False, boolean, "accepted: tpzoo's attention softmax is always float32",
                                             "--attention-softmax-in-fp32", launch=True)


def add_architecture_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's architecture flags (``ArchitectureConfig``)."""
    add_section(parser, ArchitectureConfig, "model architecture (Megatron-LM's flags; docs/models.md)")


def add_speed_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's speed flags (``tpzoo.training.parallel_config.SpeedConfig``), and its values of
    ``--attention-backend`` (defined by ``tpzoo.training.args.add_precision_args``, which must come first) besides
    tpzoo's."""
    backend = parser._option_string_actions["--attention-backend"]
    backend.choices = (*backend.choices, *MEGATRON_ATTENTION_BACKENDS)
    backend.help = "Megatron-LM's flash and fused = sdpa, local and unfused = fused-softmax"
    add_section(parser, SpeedConfig, "speed (Megatron-LM's flags; docs/training.md)")


def option(config_class: type, name: str) -> Any:
    return next((f for f in dataclasses.fields(config_class) if f.name == name), None)


def _takes(config_class: type, trait: str, value: Any) -> bool:
    """Whether a config of ``config_class`` can have Megatron-LM trait ``trait`` = ``value`` (its fields' checks)."""
    if trait == "group_query_attention":
        return not value or option(config_class, "num_query_groups") is not None
    if trait == "num_experts":  # any count, in a family of mixtures of experts; none, in one of dense MLPs
        return (value is None) == (option(config_class, "num_experts") is None)
    if trait == "swiglu":
        field, wanted = option(config_class, "activation"), [a for a in ACTIVATIONS if (a == "swiglu") == value]
    else:
        field, wanted = option(config_class, trait), [value]
    check = field.metadata.get("check") or (lambda v: None if v == field.default else "other")  # a plain default
    return any(check(v) is None for v in wanted)


def _family_value(config_class: type, trait: str) -> Any:
    """The trait of the family's default config."""
    if trait == "group_query_attention":
        return False
    if trait == "swiglu":
        return option(config_class, "activation").default == "swiglu"
    if trait == "num_experts":
        return getattr(option(config_class, trait), "default", None)
    return option(config_class, trait).default


def _show(trait: str, value: Any) -> str:
    """A trait's value as the flags say it."""
    if trait == "add_bias_linear":
        return "--add-bias-linear" if value else "--disable-bias-linear"
    if trait == "window_size":
        return f"--window-size {value - 1},0" if value else "no --window-size"
    if trait == "num_experts":
        return f"--num-experts {value}" if value else "no --num-experts"
    if isinstance(value, bool):
        flag = f"--{trait.replace('_', '-')}"
        return flag if value else f"no {flag}"
    return f"--{trait.replace('_', '-')} {value}"


def _differences(name: str, wanted: dict[str, Any]) -> list[str]:
    """``flags X (family: Y)`` for each trait of ``wanted`` that the family ``name``'s config cannot have."""
    config_class = family(name).config_class
    return [f"{_show(t, v)} ({name}: {_show(t, _family_value(config_class, t))})"
            for t, v in wanted.items() if not _takes(config_class, t, v)]


def resolve_architecture(args: argparse.Namespace) -> None:
    """Check the architecture flags and set ``args.model`` (when None: the family they describe) and
    ``args.architecture_changes`` (the config fields they set). Done once (a second call returns).
    ValueError naming the flags and the family for a combination it cannot build."""
    if getattr(args, "architecture_changes", None) is not None:
        return
    given = {t: getattr(args, t) for t in TRAITS if getattr(args, t) is not None}
    described = args.model is None
    if described:
        wanted = {**TRAITS, **given}
        fits = [name for name in FAMILIES if not _differences(name, wanted)]
        if not fits:
            nearest = min(FAMILIES, key=lambda name: len(_differences(name, wanted)))
            raise ValueError(f"no model family has the architecture these flags describe; the nearest, {nearest}, "
                             f"differs in {'; '.join(_differences(nearest, wanted))}: change those flags (a flag "
                             f"not given means Megatron-LM's default) or pass --model")
        args.model = args.default_model if args.default_model in fits else fits[0]
    else:
        wrong = _differences(args.model, given)
        if wrong:
            fits = [name for name in FAMILIES if not _differences(name, given)]
            instead = f" or pass --model {fits[0]}" if fits else ""
            raise ValueError(f"--model {args.model} disagrees with the architecture flags: {'; '.join(wrong)}; drop "
                             f"those flags{instead}")
    args.architecture_changes = _config_changes(args, described)
    _check_kv_channels(args)


def _config_changes(args: argparse.Namespace, described: bool) -> dict[str, Any]:
    """The config fields the flags set (``described``: the family was picked by the flags, whose
    absent tie and grouping flags then mean Megatron-LM's tied, ungrouped model)."""
    config_class = family(args.model).config_class
    grouped = option(config_class, "num_query_groups") is not None
    changes: dict[str, Any] = {}
    if args.norm_epsilon is not None:
        changes["layernorm_epsilon"] = args.norm_epsilon
    if args.rotary_percent not in (None, 1.0):
        if option(config_class, "rotary_percent") is None:
            raise ValueError(f"--rotary-percent {args.rotary_percent}: --model {args.model} rotates every feature of a "
                             f"head; drop it or pass 1.0 (partial rotary: a family whose config has rotary_percent)")
        changes["rotary_percent"] = args.rotary_percent
    for flag, given in (("--rotary-base", args.rotary_base), ("--use-rope-scaling", args.use_rope_scaling)):
        if given is not None and option(config_class, "rotary_base") is None:  # model_config sets --rotary-base
            raise ValueError(f"{flag} applies to rotary positions, but --model {args.model} has "
                             f"{_family_value(config_class, 'position_embedding_type')} ones; drop it")
    if args.use_rope_scaling is not None:
        changes["rope_scaling"] = args.use_rope_scaling
    if args.untie_embeddings_and_output_weights or described:
        changes["tie_word_embeddings"] = not args.untie_embeddings_and_output_weights
    if grouped and args.num_query_groups is None and (args.group_query_attention or described):
        changes["num_query_groups"] = 1 if args.group_query_attention else None
    return changes


def _check_kv_channels(args: argparse.Namespace) -> None:
    """--kv-channels must be hidden size / heads (the flags', else the preset's) in a family whose heads have no size
    of their own."""
    if args.kv_channels is None or _takes(family(args.model).config_class, "kv_channels", args.kv_channels):
        return
    preset = PRESETS[args.preset or family(args.model).default_preset]
    hidden = args.hidden_size or preset["hidden_size"]
    heads = args.num_attention_heads or preset["num_attention_heads"]
    if args.kv_channels * heads != hidden:
        raise ValueError(f"--kv-channels {args.kv_channels}: {args.model}'s heads have hidden size / heads = {hidden} / "
                         f"{heads} features each; drop --kv-channels, pass {hidden // heads} or use a family whose "
                         f"heads have a size of their own (qwen3, llama, mistral)")


def resolve_speed(args: argparse.Namespace) -> None:
    """Megatron-LM's speed flags onto tpzoo's: ``args.attention_backend`` and ``args.kernels`` set to
    tpzoo's values; ValueError naming the flags that disagree, or --overlap-param-gather without FSDP.
    Calling it again changes nothing."""
    backend = MEGATRON_ATTENTION_BACKENDS.get(args.attention_backend, args.attention_backend)
    if args.use_flash_attn:
        if backend not in ("auto", "sdpa"):
            raise ValueError(f"--use-flash-attn means --attention-backend sdpa, but --attention-backend is "
                             f"{args.attention_backend}; drop one of them")
        backend = "sdpa"
    args.attention_backend = backend
    unfused = [f"--no-{name.replace('_', '-')}-fusion" for name in KERNEL_FUSIONS if getattr(args, f"no_{name}_fusion")]
    if unfused:
        if args.kernels not in ("auto", "torch"):
            raise ValueError(f"{', '.join(unfused)} mean --kernels torch, but --kernels is {args.kernels}; drop one")
        args.kernels = "torch"
    if args.overlap_param_gather and not args.use_torch_fsdp2:
        raise ValueError("--overlap-param-gather: tpzoo overlaps weight gathers with compute under --use-torch-fsdp2 "
                         "only (the distributed optimizer broadcasts the updated weights after the step); add "
                         "--use-torch-fsdp2 or drop it")
    problem = recompute_problem(args.recompute_activations, args.recompute_granularity, args.recompute_method,
                                args.recompute_num_layers)
    if problem:
        raise ValueError(problem)
