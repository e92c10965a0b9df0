"""Per-rank memory of plain data parallelism, ZeRO-1, ZeRO-2, FSDP and LoRA, measured after a training step.

    python bench/memory.py --check                  # gpt-tiny at dp 2, 4, 8 (8 gloo ranks without a GPU)
    python bench/memory.py --preset gpt2-xl --dp 1 --modes plain fsdp --recompute    # one GPU: peak, tokens/s
    python bench/memory.py --preset llama-1b --dp 1 --modes plain lora               # LoRA against full fine-tuning
    python bench/memory.py --cp 1 2 4 --preset llama-tiny --seq-length 2048          # activations per rank under cp

For each dp and mode, dp ranks (``tpzoo.testing.spawn``; one GPU each with ``--device cuda``) build the
preset's pretraining model under ``tpzoo.engine.Engine`` at (tp, pp, dp) = (1, 1, dp), run one step over a
global batch of micro-batch x dp sequences, and count, right after it (gradients still held):

    weights     distinct storages of the model's parameters (FSDP: the local shards) and of the float32
                main weights (ZeRO's stand-ins for parameters another rank owns: one expanded element)
    gradients   distinct storages of the model's and the main parameters' gradients
    optimizer   ``optimizer_state_bytes``: AdamW's moments and step counts
    gathered    FSDP: the largest unit unsharded in the compute dtype (a layer, the embedding, the head, or the
                root unit: a tied embedding and head and the rest), what FSDP holds on top at its peak

Each figure is the maximum over the ranks. ``plain`` is data parallelism without sharding (every weight trained:
full fine-tuning), ``zero1`` and ``zero2`` ``use_distributed_optimizer`` with ``zero_stage`` 1 and 2, ``fsdp``
``ParallelPlan(fsdp=True)``, ``lora`` plain with LoRA adapters of rank ``--lora-rank`` on the attention's
projections (finetune.py's default targets), every other weight frozen.
With ``--steps N`` (default 3 on CUDA, 0 elsewhere) N more steps are timed: tokens/s = global batch x
sequence / median step time; on CUDA also the peak (``torch.cuda.max_memory_allocated`` over those steps).

``--cp C1 C2 ...`` measures activations instead: for each cp and attention mode (``--cp-comm-type``, default both),
cp ranks build the preset's pretraining model at (tp, pp, dp, cp) = (1, 1, 1, cp), take their pieces of one
micro-batch (``tpzoo.engine.context_cut``) and count the bytes of the distinct storages a training forward keeps for
backward (``torch.autograd.graph.saved_tensors_hooks``; the parameters left out): what a long sequence costs a rank,
in bytes, so the CPU's load does not matter. With ``--check`` it exits 1 unless each rank's bytes at cp c are at
most 1.25 / c of cp 1's.

``--check`` exits 1 unless, at every dp, with P the plain total and L the largest parameter's share of
the elements (ZeRO owns whole parameters, largest first, so no rank holds more than 1/dp + L of them):

    FSDP total <= 1.1 / dp x P + gathered       (the issue's bound; FSDP's optimizer state <= 1.1 / dp of plain's)
    ZeRO-1, ZeRO-2 optimizer state <= (1/dp + L) x plain's;  ZeRO-2 gradients <= (1/dp + L) x plain's
    ZeRO-1 gradients = plain's                  (all-reduced: every rank keeps them all)
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from datetime import date
from typing import Callable

import torch
from baselines import make_batch  # bench/, the script's folder
from torch.distributed.fsdp import FSDPModule

from tpzoo.engine import Engine, EngineConfig
from tpzoo.lora_options import LoRAConfig
from tpzoo.engine.config import PRECISIONS
from tpzoo.engine.context_cut import cut_sequences
from tpzoo.engine.data_parallel import optimizer_state_bytes
from tpzoo.engine.mixed_precision import DTYPES
from tpzoo.models import get_preset
from tpzoo.models.families import PRESETS, family
from tpzoo.models.build import build_model
from tpzoo.parallel import ParallelMesh, ParallelPlan, init_mesh
from tpzoo.parallel.fsdp import local
from tpzoo.parallel.lora import add_adapters
from tpzoo.testing import spawn

MODES = {"plain": {}, "zero1": dict(use_distributed_optimizer=True, zero_stage=1),
         "zero2": dict(use_distributed_optimizer=True, zero_stage=2), "fsdp": {}, "lora": {}}
PARTS = ("weights", "gradients", "optimizer")
MiB = 2.0**20


def storage_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's: its local shard's): what is allocated."""
    held = {}
    for t in tensors:
        if t is not None:
            s = local(t).untyped_storage()
            held[s.data_ptr()] = s.nbytes()
    return sum(held.values())


def unit_sizes(engine: Engine) -> list[int]:
    """Elements of each FSDP unit of this rank's chunks, unsharded: every ``FSDPModule`` (a layer, the embedding,
    the head, the chunk as root unit) less the units inside it."""
    sizes = []
    for unit in (m for chunk in engine.chunks for m in chunk.modules() if isinstance(m, FSDPModule)):
        inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
        sizes.append(sum(p.numel() for p in unit.parameters() if id(p) not in inner))
    return sizes


def held(engine: Engine) -> dict[str, int]:
    """Bytes this rank holds of each of ``PARTS`` (see the module docstring)."""
    models, mains = engine.params, engine.main.params
    return {"weights": storage_bytes([*models, *mains]),
            "gradients": storage_bytes([p.grad for p in (*models, *mains)]),
            "optimizer": optimizer_state_bytes(engine.optimizer)}


def with_adapters(build: Callable[..., torch.nn.Module], rank: int, plan: ParallelPlan, **stage) -> torch.nn.Module:
    """``build``'s model with LoRA adapters of ``rank`` (finetune.py's default targets), the rest frozen."""
    model = build(plan, **stage)
    add_adapters(model, LoRAConfig(rank=rank))
    return model


def measure(mode: str, mesh: ParallelMesh, preset: str, dp: int, precision: str, b: int, s: int, steps: int,
            recompute: bool, lora_rank: int) -> dict[str, float]:
    """This rank's figures for one mode (an Engine built, stepped, measured and dropped)."""
    config = get_preset(preset, hidden_dropout=0.0, attention_dropout=0.0)
    plan = ParallelPlan(mesh, fsdp=mode == "fsdp", recompute_activations=recompute)
    build = functools.partial(build_model, family(config.model_type).spec.pretrain_model, config)
    if mode == "lora":
        build = functools.partial(with_adapters, build, lora_rank)
    engine = Engine(build, config,
                    EngineConfig(micro_batch_size=b, global_batch_size=b * dp, precision=precision, **MODES[mode]),
                    plan)
    batch = make_batch(family(config.model_type).data, config.vocab_size, b * dp, s, torch.device("cpu"))
    engine.train_step(batch)
    out = {**held(engine), "largest": max(p.numel() for p in engine.params) / sum(p.numel() for p in engine.params)}
    if plan.fsdp:
        out["gathered"] = max(unit_sizes(engine)) * DTYPES[precision].itemsize
    cuda = mesh.device.type == "cuda"
    if steps:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.train_step(batch)  # reads the loss to the host: the step is done on the device
            times.append(time.perf_counter() - start)
        out["tokens/s"] = b * dp * s / statistics.median(times)
        if cuda:
            out["peak"] = torch.cuda.max_memory_allocated()
    del engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def measure_all(device: str, modes: list[str], preset: str, dp: int, *args) -> dict[str, dict[str, float]]:
    """Every mode on this rank, one after another on one mesh (1, 1, dp) of ``device``'s type."""
    mesh = init_mesh(tp=1, pp=1, dp=dp, device_type=device)
    return {mode: measure(mode, mesh, preset, dp, *args) for mode in modes}


def worst(ranks: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per mode and figure, the maximum over the ranks (tokens/s: the minimum, the slowest rank's view)."""
    pick = {"tokens/s": min}
    return {mode: {k: pick.get(k, max)(r[mode][k] for r in ranks) for k in ranks[0][mode]} for mode in ranks[0]}


def problems(dp: int, figures: dict[str, dict[str, float]]) -> list[str]:
    """What ``--check`` refuses at this dp (see the module docstring)."""
    plain, out = figures["plain"], []
    share = 1 / dp + plain["largest"]
    total = {m: sum(f[k] for k in PARTS) for m, f in figures.items()}

    def over(mode: str, what: str, got: float, bound: float) -> None:
        if got > bound:
            out.append(f"dp {dp} {mode}: {what} {got / MiB:.3f} MiB exceeds {bound / MiB:.3f} MiB")
    if "fsdp" in figures:
        over("fsdp", "total", total["fsdp"], 1.1 / dp * total["plain"] + figures["fsdp"]["gathered"])
        over("fsdp", "optimizer state", figures["fsdp"]["optimizer"], 1.1 / dp * plain["optimizer"])
    for mode in ("zero1", "zero2"):
        if mode in figures:
            over(mode, "optimizer state", figures[mode]["optimizer"], share * plain["optimizer"])
    if "zero2" in figures:
        over("zero2", "gradients", figures["zero2"]["gradients"], share * plain["gradients"])
    if "zero1" in figures and figures["zero1"]["gradients"] != plain["gradients"]:
        out.append(f"dp {dp} zero1: gradients {figures['zero1']['gradients']} bytes, plain's {plain['gradients']}")
    return out


def table(results: dict[int, dict[str, dict[str, float]]]) -> list[str]:
    """The Markdown table: one row per dp and mode, in MiB, total also as a share of plain's at that dp."""
    timed = any("tokens/s" in f for figures in results.values() for f in figures.values())
    peak = any("peak" in f for figures in results.values() for f in figures.values())
    columns = ["dp", "mode", *(f"{p} MiB" for p in PARTS), "total MiB", "x plain", "gathered MiB"]
    columns += ["tokens/s"] * timed + ["peak GiB"] * peak
    lines = [f"| {' | '.join(columns)} |", "|" + " --- |" * 2 + " ---: |" * (len(columns) - 2)]
    for dp, figures in results.items():
        plain = sum(figures["plain"][k] for k in PARTS) if "plain" in figures else None
        for mode, f in figures.items():
            total = sum(f[k] for k in PARTS)
            cells = [str(dp), mode, *(f"{f[k] / MiB:.2f}" for k in PARTS), f"{total / MiB:.2f}",
                     f"{total / plain:.3f}" if plain else "-",
                     f"{f['gathered'] / MiB:.2f}" if "gathered" in f else "-"]
            cells += ([f"{f['tokens/s']:,.0f}"] if timed else []) + ([f"{f['peak'] / 2**30:.2f}"] if peak else [])
            lines.append(f"| {' | '.join(cells)} |")
    return lines


def activation_bytes(cp: int, comm: str, preset: str, b: int, s: int, precision: str) -> int:
    """This rank's bytes kept for backward by a training forward of its pieces of b sequences of s tokens at
    (1, 1, 1, cp) (module docstring)."""
    config = get_preset(preset, hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=s)
    mesh = init_mesh(cp=cp)
    spec = family(config.model_type).spec
    model = build_model(spec.pretrain_model, config, ParallelPlan(mesh, cp_comm_type=comm)).to(DTYPES[precision])
    batch = make_batch(family(config.model_type).data, config.vocab_size, b, s, mesh.device)
    balanced = getattr(model, "causal", True)
    mine = cut_sequences(batch, cp, mesh.cp_rank, balanced) if cp > 1 else batch
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**mine)
    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    return sum(kept.values())


def activation_table(args: argparse.Namespace, b: int, s: int) -> tuple[list[str], list[str]]:
    """(the Markdown table of ``--cp``: a row per cp and mode (cp 1: one row), the largest rank's bytes, against the
    first cp's; ``--check``'s failures)."""
    runs = list(dict.fromkeys((cp, comm if cp > 1 else "-") for cp in args.cp for comm in args.cp_comm_type))
    got = {(cp, comm): max(spawn(activation_bytes, cp, cp, "p2p" if comm == "-" else comm, args.preset, b, s,
                                 args.precision, timeout=1800)) for cp, comm in runs}
    first = args.cp[0]
    lines = ["| cp | mode | activations MiB | x cp " + str(first) + " |", "| --- | --- | ---: | ---: |"]
    failed = []
    for (cp, comm), kept in got.items():
        base = got.get((first, comm if first > 1 else "-"), kept)
        lines.append(f"| {cp} | {comm} | {kept / MiB:.2f} | {kept / base:.3f} |")
        if kept > 1.25 * first / cp * base:
            failed.append(f"cp {cp} {comm}: {kept / MiB:.2f} MiB a rank, more than 1.25 x {first} / {cp} of cp "
                          f"{first}'s {base / MiB:.2f} MiB")
    return lines, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt-tiny", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8], help="data-parallel sizes, one spawn each")
    p.add_argument("--modes", nargs="+", default=[m for m in MODES if m != "lora"], choices=list(MODES),
                   help="what to measure (default: the data-parallel ones)")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS, help="EngineConfig.precision")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per rank (default: 8 on CUDA, 1)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (default: 1024 on CUDA, 64)")
    p.add_argument("--steps", type=int, default=None, help="timed steps after the measured one (default: 3 on "
                                                           "CUDA, 0)")
    p.add_argument("--recompute", action="store_true", help="recompute each layer's activations in backward")
    p.add_argument("--lora-rank", type=int, default=8, help="the adapters' rank in the lora mode")
    p.add_argument("--check", action="store_true", help="exit 1 unless the sharding bounds hold (docstring)")
    p.add_argument("--cp", type=int, nargs="+", help="context-parallel sizes: the activations per rank instead "
                   "(docstring); the first is the baseline, usually 1")
    p.add_argument("--cp-comm-type", nargs="+", default=["p2p", "a2a"], choices=("p2p", "a2a"),
                   help="with --cp: the attention modes")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    b = args.micro_batch_size or (8 if cuda else 1)
    config = get_preset(args.preset)
    positions = config.max_position_embeddings
    s = args.seq_length or min(1024 if cuda else 64, positions)
    steps = (3 if cuda else 0) if args.steps is None else args.steps
    if args.cp:
        if min(args.cp) < 1 or any(s % (2 * cp) for cp in args.cp):
            p.error(f"--cp sizes must be >= 1 and 2 x cp must divide --seq-length {s}; got {args.cp}")
        if cuda:
            p.error("--cp measures bytes kept for backward, the same on any device: run it with --device cpu")
        print(f"{args.preset}, {args.precision}, activations of {b} x {s} tokens split over cp ranks; torch "
              f"{torch.__version__}; {date.today()}")
        lines, failed = activation_table(args, b, s)
        print("\n".join(lines))
        if args.check:
            print("\n" + ("\n".join(f"CHECK FAILED: {f}" for f in failed) if failed else "check: the bounds hold"))
        return 1 if args.check and failed else 0
    if min(args.dp) < 1 or b < 1 or steps < 0 or args.lora_rank < 1 or not 1 <= s <= positions:
        p.error(f"need --dp, --micro-batch-size and --lora-rank >= 1, --steps >= 0 and 1 <= --seq-length <= "
                f"{positions} (the preset's positions), got {args.dp}, {b}, {args.lora_rank}, {steps} and {s}")
    if args.check and "plain" not in args.modes:
        p.error("--check compares with plain data parallelism: add plain to --modes")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU; use --device cpu")
    if cuda and max(args.dp) > torch.cuda.device_count():
        p.error(f"--dp {max(args.dp)} needs as many GPUs, {torch.cuda.device_count()} visible; lower --dp")
    modes = [m for m in MODES if m in args.modes]
    device = torch.cuda.get_device_name() if cuda else "CPU, gloo"
    n = family(config.model_type).spec.num_parameters(config, None)
    print(f"{args.preset} ({n / 1e6:.2f}M parameters), {args.precision}, micro-batch {b} x {s} tokens per rank"
          f"{', recompute' if args.recompute else ''}; {device}; torch {torch.__version__}; {date.today()}")
    results = {dp: worst(spawn(measure_all, dp, args.device, modes, args.preset, dp, args.precision, b, s, steps,
                               args.recompute, args.lora_rank, timeout=1800)) for dp in args.dp}
    print("\n".join(table(results)))
    if not args.check:
        return 0
    failed = [line for dp, figures in results.items() for line in problems(dp, figures)]
    print("\n" + ("\n".join(f"CHECK FAILED: {line}" for line in failed) if failed else "check: the bounds hold"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
