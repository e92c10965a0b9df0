"""Training-step speed of tpzoo against what a user picks instead, in one run on one device.

    python bench/models.py          # CUDA: gpt2, gpt2-xl, bert-large, llama-1b, mixtral-1b; CPU: a tiny smoke run of
                                    # each family
    python bench/models.py --models gpt2 --micro-batch-size 16 --contenders tpzoo-compile,plain-compile

Contenders (``--contenders``), every one from tpzoo's initial weights (converted with tpzoo.convert)
and one fixed batch, so all start from the same loss (checked: a first loss further than LOSS_RTOL
from the first contender's is a bug, named below the table, and the script exits 1):

    tpzoo           tpzoo.engine.Engine at tp 1 with EngineConfig(precision="bf16") on CUDA (fp32 on
                    the CPU): forward, backward, clipping to norm 1 and AdamW, the step a user's run takes
    tpzoo-compile   the same with ParallelPlan(mesh, compile=True)
    tpzoo-torch     tpzoo with ParallelPlan(kernels="torch"): torch's own norms and GELU in place of the Triton
                    kernels (tpzoo-torch-compile: compiled, inductor then fuses them): the kernels' share of a step
    plain           the family's plain PyTorch model (bench/baselines.py), bf16 autocast, fused AdamW,
                    clipping to norm 1; plain-compile: under torch.compile, what a nanoGPT user runs
    hf, hf-compile  the family's Hugging Face model (baselines.REFERENCES) the same way, eager and compiled

The contenders take turns step by step, so a noisy machine slows them alike; each runs ``--warmup``
untimed steps (the first compiles), then ``--steps`` timed ones. Below the table: each model's target
(TARGETS, the issue's) and whether the best tpzoo contender meets it. Columns of the table:

    ms/step, median ms   best and median time of one optimizer step (the best is the least disturbed)
    tokens/s             micro-batch x sequence length / best time
    MFU                  flops_per_token x tokens/s / the device's peak dense bf16 FLOP/s (bench/flops.py)
    peak GiB             torch.cuda.max_memory_allocated during its timed steps, counting its own tensors
                         only (the others' resident state is subtracted)
    loss@0, d loss@0     its first loss; that minus the first listed contender's
    x plain-compile, x hf-compile   its tokens/s over that contender's, from the same run

Memory: a contender keeps its weights, gradients and AdamW state (about STATE_BYTES per parameter)
resident while all take turns. When that, for all of them, exceeds the free device memory
(``--memory-gib`` sets the budget), or a step runs out of memory, they run one after another
(said below the table); a model whose state alone exceeds it, or a contender that runs out of
memory alone, is reported skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from typing import Callable

import torch
import transformers
from baselines import REFERENCES, hf_inputs, load_hf, make_batch  # bench/, the script's folder
from flops import flops_per_token, parameter_counts, peak_flops
from torch import nn

from tpzoo.convert import architectures, tpzoo_to_hf
from tpzoo.convert.hf import write_hf
from tpzoo.engine import Engine, EngineConfig
from tpzoo.models import full_state_dict, get_preset
from tpzoo.models.compile import BACKEND_ENV
from tpzoo.models.config import ModelConfig
from tpzoo.models.families import PRESETS, family
from tpzoo.models.build import build_model
from tpzoo.parallel import ParallelPlan, init_mesh

CUDA = torch.cuda.is_available()
CONTENDERS = ("tpzoo", "tpzoo-compile", "tpzoo-torch", "tpzoo-torch-compile", "plain", "plain-compile", "hf",
              "hf-compile")
DEFAULT_CONTENDERS = ("tpzoo", "tpzoo-compile", "plain-compile", "hf", "hf-compile")
RATIO_TO = ("plain-compile", "hf-compile")
COLUMNS = ("model", "shape", "contender", "ms/step", "median ms", "tokens/s", "MFU", "peak GiB", "loss@0", "d loss@0",
           *(f"x {r}" for r in RATIO_TO))
# preset -> (micro-batch size, sequence length): the shapes on CUDA, tiny ones on the CPU; other
# presets: DEFAULT_SHAPE (the sequence no longer than the model's positions)
SHAPES = {"gpt2": (8, 1024), "gpt2-xl": (8, 1024), "bert-large": (64, 128), "llama-1b": (4, 2048),
          "mixtral-1b": (4, 2048), **{name: (2, 64) for name in ("gpt-tiny", "bert-tiny", "llama-tiny", "qwen2-tiny",
                                                                  "qwen3-tiny", "mistral-tiny", "mixtral-tiny")}}
DEFAULT_SHAPE = (8, 1024) if CUDA else (2, 64)
KNOWN_MODELS = [name for name, fields in PRESETS.items() if fields["model_type"] in REFERENCES]
DEFAULT_MODELS = (("gpt2", "gpt2-xl", "bert-large", "llama-1b", "mixtral-1b") if CUDA else
                  ("gpt-tiny", "bert-tiny", "llama-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny", "mixtral-tiny"))
STATE_BYTES = 16          # per parameter: weights, gradients, AdamW's two moments (fp32; or bf16 + fp32 main)
LOSS_RTOL = {"bf16": 1e-2, "fp32": 1e-4}
LR = 1e-4
GiB = 2.0**30


@dataclasses.dataclass(frozen=True)
class Target:
    """The issue's goal for a model: the best tpzoo contender reaches ``mfu`` and, with a ``reference``,
    ``ratio`` x that contender's tokens/s."""

    mfu: float
    reference: str | None = None
    ratio: float = 0.0

    def __str__(self) -> str:
        ratio = f"{self.ratio}x {self.reference} tokens/s and " if self.reference else ""
        return f"tpzoo >= {ratio}>= {self.mfu:.0%} MFU"


TARGETS = {"gpt2": Target(0.38, "plain-compile", 1.2), "gpt2-xl": Target(0.45),
           "bert-large": Target(0.40, "hf-compile", 1.4), "llama-1b": Target(0.45, "hf-compile", 1.1)}


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


@dataclasses.dataclass
class Setup:
    """One model's benchmark: config, the batch every contender reads, tpzoo's initial weights."""

    preset: str
    config: ModelConfig
    batch: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]            # full state dict (CPU) of tpzoo's model, before any step
    plan: ParallelPlan
    precision: str

    @property
    def model(self) -> tuple[str, dict]:
        """tpzoo's class name and constructor options for the family's Hugging Face reference."""
        return architectures()[REFERENCES[self.config.model_type].hf_architecture]


def make_setup(preset: str, b: int, s: int, plan: ParallelPlan, precision: str, layers: int | None) -> Setup:
    """The model of ``preset`` (``layers`` layers, None: the preset's; no dropout), a batch of b x s tokens;
    no weights yet (``load_weights``)."""
    config = get_preset(preset, hidden_dropout=0.0, attention_dropout=0.0, **({"num_layers": layers} if layers else {}))
    batch = make_batch(family(config.model_type).data, config.vocab_size, b, s, plan.mesh.device)
    return Setup(preset, config, batch, {}, plan, precision)


def load_weights(setup: Setup) -> None:
    """``setup.state``: the weights of tpzoo's model drawn from the plan's seed, as its engines draw them."""
    cls, options = setup.model
    source = build_model(cls, setup.config, setup.plan, **options)
    setup.state = {k: v.detach().float().cpu() for k, v in full_state_dict(source).items()}


def tpzoo_step(setup: Setup, compile: bool, kernels: str | None = None) -> Callable[[], float]:
    """One Engine.train_step over the batch (m = 1 micro-batch) under the setup's plan with ``compile`` and
    ``kernels`` (None: the plan's), a mixture of experts' experts as one grouped multiply (``--moe-grouped-gemm``);
    returns the loss before the update."""
    cls, options = setup.model
    b = setup.batch["input_ids"].shape[0]
    engine = Engine(functools.partial(build_model, cls, setup.config, **options), setup.config,
                    EngineConfig(micro_batch_size=b, global_batch_size=b, lr=LR, precision=setup.precision),
                    dataclasses.replace(setup.plan, compile=compile, kernels=kernels or setup.plan.kernels,
                                        grouped_gemm=hasattr(setup.config, "num_experts")))
    return lambda: engine.train_step(setup.batch).loss


def torch_step(setup: Setup, which: str, compile: bool) -> Callable[[], float]:
    """A step of the Hugging Face (``which`` "hf") or plain PyTorch model with tpzoo's weights: autocast
    under bf16, backward, clipping to norm 1, fused AdamW; returns the loss before the update."""
    ref, (cls, options) = REFERENCES[setup.config.model_type], setup.model
    hf_config, hf_state, tied = tpzoo_to_hf(cls, options, setup.config, setup.state)
    hf_config.use_cache = False
    if which == "hf":  # opened as a user opens it: from_pretrained of the folder to-hf writes (its checkpoints' layout)
        with tempfile.TemporaryDirectory() as folder:
            write_hf(folder, hf_config, hf_state, tied)
            model = getattr(transformers, ref.hf_architecture).from_pretrained(folder, torch_dtype=torch.float32)
        model = model.to(setup.plan.mesh.device)
        inputs = hf_inputs(family(setup.config.model_type).data, setup.batch)
    else:
        with torch.device(setup.plan.mesh.device):
            model = ref.plain(setup.config)
            load_hf(model, hf_state, ref.renames, tied)
        inputs = dict(input_ids=setup.batch["input_ids"], labels=setup.batch["labels"])
    model.train()
    run = torch.compile(model) if compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)

    def step() -> float:
        with torch.autocast(setup.plan.mesh.device.type, torch.bfloat16, enabled=setup.precision == "bf16"):
            out = run(**inputs)
            loss = out if which == "plain" else out.loss
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


@dataclasses.dataclass
class Entry:
    """A contender's measurements; ``resident``: bytes it holds on the device between steps."""

    resident: int
    first: float = math.nan
    times: list[float] = dataclasses.field(default_factory=list)
    peak: int = 0


def build(setup: Setup, name: str) -> tuple[Callable[[], float], Entry]:
    """The contender's step function, and its Entry holding the bytes its building allocated."""
    before = allocated()
    compiled, kind = name.endswith("-compile"), name.removesuffix("-compile")
    if kind.startswith("tpzoo"):
        step = tpzoo_step(setup, compiled, "torch" if kind == "tpzoo-torch" else None)
    else:
        step = torch_step(setup, kind, compiled)
    return step, Entry(allocated() - before)


def measure(setup: Setup, names: list[str], warmup: int, steps: int) -> dict[str, Entry]:
    """Build every contender of ``names``, then ``warmup`` + ``steps`` rounds of one step each; the
    contenders are freed on return (the entries hold numbers only)."""
    built = {name: build(setup, name) for name in names}
    for i in range(warmup + steps):
        for step, e in built.values():
            if CUDA:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start, at = allocated(), time.perf_counter()
            loss = step()                                      # .item(): waits for the step
            elapsed = time.perf_counter() - at
            peak = torch.cuda.max_memory_allocated() - start + e.resident if CUDA else 0
            e.resident += allocated() - start                  # AdamW's state appears at the first step
            if i == 0:
                e.first = loss
            if i >= warmup:
                e.times.append(elapsed)
                e.peak = max(e.peak, peak)
    return {name: e for name, (_, e) in built.items()}


def release() -> None:
    """Free what the last contenders held (compiled graphs included)."""
    torch._dynamo.reset()
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def run_model(setup: Setup, names: list[str], budget: float, args: argparse.Namespace
              ) -> tuple[dict[str, Entry | str], str | None]:
    """Each contender's Entry, or why it was skipped; and a note when they ran one after another."""
    total, _ = parameter_counts(setup.config)
    need = STATE_BYTES * total
    out: dict[str, Entry | str] = {n: f"skipped: no plain PyTorch {setup.config.model_type} here" for n in names
                                   if n.startswith("plain") and REFERENCES[setup.config.model_type].plain is None}
    run = [n for n in names if n not in out]
    note, skip = None, None
    if need > budget:
        skip = f"skipped: its state needs ~{need / GiB:.2g} GiB ({STATE_BYTES} B x {total:,} parameters), " \
               f"{budget / GiB:.2g} GiB free"
    else:
        try:
            load_weights(setup)
        except torch.cuda.OutOfMemoryError:
            skip = "skipped: out of memory"
    if skip:
        out.update({n: skip for n in run})
        run = []
        release()
    if need * len(run) <= budget:
        try:
            out.update(measure(setup, run, args.warmup, args.steps))
            run = []
        except torch.cuda.OutOfMemoryError:
            pass
        release()
    if len(run) > 1:
        note = (f"{setup.preset}: the contenders ran one after another, not interleaved (together they do not "
                f"fit {budget / GiB:.2g} GiB)")
    for name in run:
        try:
            out.update(measure(setup, [name], args.warmup, args.steps))
        except torch.cuda.OutOfMemoryError:
            out[name] = "skipped: out of memory"
        release()
    return {n: out[n] for n in names}, note


def report(setup: Setup, results: dict[str, Entry | str], peak: float | None, rtol: float) -> list[str]:
    """The model's table rows, its target line (if any) and each first-loss disagreement (lines "FIRST LOSS")."""
    b, s = setup.batch["input_ids"].shape
    flops = flops_per_token(setup.config, s)
    ran = {n: e for n, e in results.items() if isinstance(e, Entry)}
    tokens = {n: b * s / min(e.times) for n, e in ran.items()}
    ref_loss = next((e.first for e in ran.values()), math.nan)
    rows, notes = [], []
    for name, e in results.items():
        if not isinstance(e, Entry):
            rows.append(f"| {setup.preset} | {b}x{s} | {name} | {e} |" + " - |" * (len(COLUMNS) - 4))
            continue
        mfu = f"{flops * tokens[name] / peak:.1%}" if peak else "-"
        mem = f"{e.peak / GiB:.2f}" if CUDA else "-"
        ratios = [f"{tokens[name] / tokens[r]:.2f}" if r in tokens else "-" for r in RATIO_TO]
        rows.append(f"| {setup.preset} | {b}x{s} | {name} | {min(e.times) * 1e3:.1f} | "
                    f"{statistics.median(e.times) * 1e3:.1f} | {tokens[name]:,.0f} | {mfu} | {mem} | {e.first:.4f} | "
                    f"{e.first - ref_loss:+.2e} | {' | '.join(ratios)} |")
        if not abs(e.first - ref_loss) <= rtol * abs(ref_loss):
            notes.append(f"FIRST LOSS: {setup.preset} {name} starts at {e.first:.6f}, the first contender at "
                            f"{ref_loss:.6f} (same weights and batch; allowed relative difference {rtol})")
    target = TARGETS.get(setup.preset)
    mine = [n for n in tokens if n.startswith("tpzoo")]
    if target and mine:
        best = max(mine, key=tokens.get)
        held = [flops * tokens[best] / peak >= target.mfu if peak else None]
        got = f"{flops * tokens[best] / peak:.1%} MFU" if peak else "MFU unknown on this device"
        if target.reference in tokens:
            ratio = tokens[best] / tokens[target.reference]
            held.append(ratio >= target.ratio)
            got = f"{ratio:.2f}x {target.reference}, {got}"
        elif target.reference:
            held.append(None)
            got = f"{target.reference} did not run, {got}"
        verdict = "undecided" if None in held else "met" if all(held) else "not met"
        notes.append(f"target {setup.preset}: {target}: {best} {got} -> {verdict}")
    return rows + notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated presets")
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS), help=f"comma-separated, of {CONTENDERS}")
    p.add_argument("--micro-batch-size", type=int, help="sequences per step (default: per model, SHAPES)")
    p.add_argument("--seq-length", type=int, help="tokens per sequence (default: per model, SHAPES)")
    p.add_argument("--steps", type=int, default=20 if CUDA else 1, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=3 if CUDA else 1, help="untimed steps per contender, the first "
                                                                         "(compiling) included")
    p.add_argument("--num-layers", type=int, default=None if CUDA else 2,
                   help="cut every model to this many layers (default: the preset's; 2 without CUDA)")
    p.add_argument("--compile-backend", default="inductor" if CUDA else "eager",
                   help="torch.compile's backend (default: inductor; eager, dynamo's tracing only, without CUDA)")
    p.add_argument("--memory-gib", type=float, help="device memory the contenders may hold (default: what is free)")
    args = p.parse_args(argv)
    models, names = args.models.split(","), args.contenders.split(",")
    if unknown := [m for m in models if m not in KNOWN_MODELS]:
        p.error(f"unknown --models {','.join(unknown)}; choose from {','.join(KNOWN_MODELS)}")
    if unknown := [n for n in names if n not in CONTENDERS]:
        p.error(f"unknown --contenders {','.join(unknown)}; choose from {','.join(CONTENDERS)}")
    if min(args.steps, args.warmup, 1 if args.num_layers is None else args.num_layers) < 1:
        p.error(f"--steps, --warmup and --num-layers must be >= 1, got {args.steps}, {args.warmup} and "
                f"{args.num_layers}")
    positions = {m: get_preset(m).max_position_embeddings for m in models}
    shapes = {m: (args.micro_batch_size or SHAPES.get(m, DEFAULT_SHAPE)[0],
                  args.seq_length or min(SHAPES.get(m, DEFAULT_SHAPE)[1], positions[m])) for m in models}
    if too_long := [f"{m} ({positions[m]})" for m in models if shapes[m][1] > positions[m]]:
        p.error(f"--seq-length {args.seq_length} exceeds the positions of {', '.join(too_long)}; use a shorter one")
    os.environ[BACKEND_ENV] = args.compile_backend                    # tpzoo's compile (tpzoo.models.compile)
    if args.compile_backend != "inductor":
        torch.compiler.set_default_backend(args.compile_backend)      # the baselines' torch.compile
    transformers.logging.set_verbosity_error()
    precision, peak = ("bf16", peak_flops()) if CUDA else ("fp32", None)
    mesh = init_mesh(tp=1)
    device = torch.cuda.get_device_name() if CUDA else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {device}; torch {torch.__version__}, transformers {transformers.__version__}; {precision}; "
          f"compile backend {args.compile_backend}; {args.steps} timed steps after {args.warmup} warm-up, "
          + (f"every model cut to {args.num_layers} layers, " if args.num_layers else "") +
          f"contenders interleaved step by step; {date.today()}")
    if not CUDA:
        print("no CUDA: tiny models in float32, a smoke check only; CPU times are not performance results")
    print(f"| {' | '.join(COLUMNS)} |\n|" + " --- |" * 3 + " ---: |" * (len(COLUMNS) - 3))
    notes = []
    for m in models:
        budget = args.memory_gib * GiB if args.memory_gib else torch.cuda.mem_get_info()[0] if CUDA else math.inf
        setup = make_setup(m, *shapes[m], ParallelPlan(mesh), precision, args.num_layers)
        results, note = run_model(setup, names, budget, args)
        lines = report(setup, results, peak, LOSS_RTOL[precision])
        print("\n".join(line for line in lines if line.startswith("|")), flush=True)
        notes += [note] * bool(note) + [line for line in lines if not line.startswith("|")]
        del setup, results
        release()
    print("\n".join(["", *notes]))
    return 1 if any(n.startswith("FIRST LOSS") for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
