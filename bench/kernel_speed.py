"""Benchmark tpzoo's Triton kernels against torch eager and torch.compile, forward and backward.

    python bench/kernel_speed.py

On CUDA: shapes of real models (BERT-large, GPT-2 XL, 7B-class; hidden 1024-8192, sequences
512-8192) in bf16, plus rows of 16384 (longer than one block; the causal softmax at 16384 has
2^31 elements), and a smaller and a larger of those sizes in fp32 (each row compiles torch's
reference afresh: about 4 s a row on an H100, the whole table in about 2 minutes). Without CUDA: the same table at small float32 shapes, the Triton
kernels running in Triton's interpreter, so that the script is always tested; its times mean
nothing.

Columns: time of the Triton pass; GB/s counting the minimum bytes that pass must move (each
input read once, each output written once; the causal softmax reads only the visible triangle,
the masked one only the unmasked keys); that as a percentage of the device's copy bandwidth,
measured in the same run (torch copy_ of a large buffer, read + write); the speed ratio of torch
eager and of torch.compile (both running ``tpzoo.kernels.reference``) to Triton, > 1 when
Triton is faster; and the relative difference of Triton's result from eager's.

A row whose tensors would not fit in the GPU's free memory (estimated before allocating, see
``row_bytes``) prints "skipped: needs X GiB, Y GiB free" instead of its numbers.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from tpzoo import kernels as K
from tpzoo.kernels import reference as R

TRITON = {"backend": "triton"}  # the tpzoo.kernels ops below run Triton on any device

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Case:
    """One kernel at one shape, allocated: differentiable inputs, the Triton op, the reference, minimum bytes."""

    inputs: list[torch.Tensor]
    op: Callable
    ref: Callable
    fwd_bytes: int
    bwd_bytes: int


@dataclass
class Row:
    """One row of the table before any tensor exists: its labels, the elements of its largest
    tensor (x, the input), and how to build its Case."""

    kernel: str
    shape: str
    numel: int
    build: Callable[[], Case]


def softmax_case(shape: tuple[int, int, int, int], causal: bool, dtype, device) -> Case:
    b, h, sq, sk = shape
    x = torch.randn(shape, dtype=dtype, device=device)
    size, n = x.element_size(), x.numel()
    scale = sq**-0.5
    if causal:
        visible = int((torch.arange(sq) + sk - sq + 1).clamp(0, sk).sum()) * b * h
        return Case([x], lambda x: K.scaled_causal_softmax(x, scale, **TRITON),
                    lambda x: R.scaled_causal_softmax(x, scale), (visible + n) * size, (2 * visible + n) * size)
    lengths = torch.randint(sk // 2, sk + 1, (b,))
    mask = (torch.arange(sk) >= lengths[:, None]).view(b, 1, 1, sk).to(device)
    visible = int(lengths.sum()) * h * sq
    return Case([x], lambda x: K.scaled_masked_softmax(x, mask, scale, **TRITON),
                lambda x: R.scaled_masked_softmax(x, mask, scale), (visible + n) * size + mask.numel(), 3 * n * size)


def norm_case(kernel: str, rows: int, hidden: int, dtype, device) -> Case:
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    params = [torch.randn(hidden, dtype=dtype, device=device) for _ in range(2 if kernel == "layer_norm" else 1)]
    size, n, stats = x.element_size(), x.numel(), rows * 4 * (2 if kernel == "layer_norm" else 1)
    p_bytes = len(params) * hidden * size
    op, ref = getattr(K, kernel), getattr(R, kernel)
    # forward: x, params, stats in/out; backward: x, dy, w, stats in, dx, dparams out
    return Case([x, *params], lambda *a: op(*a, 1e-5, **TRITON), lambda *a: ref(*a, 1e-5),
                2 * n * size + p_bytes + stats, 3 * n * size + hidden * size + stats + p_bytes)


def gelu_case(kernel: str, rows: int, cols: int, approximate: str, dtype, device) -> Case:
    x = torch.randn(rows, cols, dtype=dtype, device=device)
    size, n = x.element_size(), x.numel()
    if kernel == "gelu":
        return Case([x], lambda x: K.gelu(x, approximate, **TRITON),
                    lambda x: R.bias_gelu(x, None, approximate), 2 * n * size, 3 * n * size)
    b = torch.randn(cols, dtype=dtype, device=device)
    return Case([x, b], lambda x, b: K.bias_gelu(x, b, approximate, **TRITON),
                lambda x, b: R.bias_gelu(x, b, approximate), 2 * n * size + cols * size,
                3 * n * size + 2 * cols * size)


def cases(dtype, device) -> list[Row]:
    """Real model shapes on CUDA (BERT-large, GPT-2 XL, 7B-class), small ones elsewhere; built lazily."""
    if device.type == "cuda" and dtype == torch.bfloat16:  # every size; rows of 16384: longer than one block
        softmax = [((16, 16, 512, 512), False), ((8, 25, 1024, 1024), True), ((1, 32, 4096, 4096), True),
                   ((1, 16, 8192, 8192), True), ((1, 8, 16384, 16384), True)]  # the last: 2^31 elements
        tokens, hiddens = 8192, (1024, 1600, 4096, 8192, 16384)
        ffn = [(4096, "none"), (6400, "tanh"), (16384, "tanh"), (32768, "tanh")]
    elif device.type == "cuda":  # fp32: a smaller and a larger size of each (each row compiles its own graph)
        softmax = [((16, 16, 512, 512), False), ((1, 32, 4096, 4096), True)]
        tokens, hiddens = 8192, (1024, 8192)
        ffn = [(4096, "none"), (16384, "tanh")]
    else:
        softmax = [((1, 2, 16, 32), False), ((1, 2, 32, 32), True)]
        tokens, hiddens = 16, (128,)
        ffn = [(128, "tanh")]
    out = [Row(f"scaled_{'causal' if c else 'masked'}_softmax", "x".join(map(str, s)) + ("" if c else " pad"),
               math.prod(s), partial(softmax_case, s, c, dtype, device)) for s, c in softmax]
    out += [Row(k, f"{tokens}x{h}", tokens * h, partial(norm_case, k, tokens, h, dtype, device))
            for k in ("layer_norm", "rms_norm") for h in hiddens]
    out += [Row(k, f"{tokens}x{c} {a}", tokens * c, partial(gelu_case, k, tokens, c, a, dtype, device))
            for k in ("gelu", "bias_gelu") for c, a in ffn]
    return out


def row_bytes(numel: int, dtype: torch.dtype) -> int:
    """Estimated peak memory of a row whose input x has ``numel`` elements of ``dtype``: 8 tensors of
    x's size and dtype alive at once (x, dy, and for each of Triton, eager and compile an output and
    an input gradient) and 6 float32 ones (what the references save for backward while the graphs
    are kept for timing, and the float32 temporaries of eager's backward). Parameters are small."""
    return numel * (8 * dtype.itemsize + 6 * 4)


def free_bytes(device: torch.device) -> int | None:
    """Bytes a row may still allocate on a CUDA device (free on the device plus what torch's allocator
    holds unused); None elsewhere, where nothing is checked."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def skip_reason(numel: int, dtype: torch.dtype, free: int | None) -> str | None:
    """None when the row fits in ``free`` bytes (or free is None), else "skipped: needs X GiB, Y GiB free"."""
    need = row_bytes(numel, dtype)
    if free is None or need <= free:
        return None
    return f"skipped: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def timer(device: torch.device) -> Callable[[Callable], float]:
    """Seconds per call: triton.testing.do_bench (CUDA events, L2 flushed) on CUDA; elsewhere one call
    after a warm-up (the interpreter's times mean nothing, and every interpreted call is slow)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, return_mode="median") / 1e3

    def cpu_time(fn: Callable) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return cpu_time


def copy_bandwidth(device: torch.device, time_fn) -> float:
    """Bytes per second of a device-to-device copy (read + write) of a large buffer."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    return 2 * n / time_fn(lambda: dst.copy_(src))


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b))


def measure(case: Case, time_fn) -> list[tuple[str, int, dict[str, float], float]]:
    """[(pass, minimum bytes, {triton, eager, compile: seconds}, rel diff from eager)], forward and backward."""
    torch._dynamo.reset()  # a fresh compile per case, never a fallback after too many recompiles
    inputs = [t.requires_grad_() for t in case.inputs]
    fns = {"triton": case.op, "eager": case.ref, "compile": torch.compile(case.ref, dynamic=False)}
    outs = {name: fn(*inputs) for name, fn in fns.items()}
    dy = torch.randn_like(outs["eager"])

    def backward(y: torch.Tensor) -> Callable:
        return lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True)

    grads = {name: backward(y)() for name, y in outs.items()}
    fwd = {name: time_fn(lambda fn=fn: fn(*inputs)) for name, fn in fns.items()}
    bwd = {name: time_fn(backward(y)) for name, y in outs.items()}
    return [("fwd", case.fwd_bytes, fwd, rel_diff([outs["triton"]], [outs["eager"]])),
            ("bwd", case.bwd_bytes, bwd, rel_diff(grads["triton"], grads["eager"]))]


COLUMNS = ["kernel", "shape", "dtype", "pass", "Triton us", "GB/s", "% of copy", "eager / Triton",
           "compile / Triton", "rel diff"]


def note_row(row: Row, dname: str, note: str) -> str:
    """The table line of a row with no numbers: the note (skipped, out of memory) in the pass column."""
    return f"| {row.kernel} | {row.shape} | {dname} | {note} |" + " |" * (len(COLUMNS) - 4)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # --help; no options
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # before torch.compile imports triton (see docs/kernels.md)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    time_fn = timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    copy = copy_bandwidth(device, time_fn)
    import triton

    print(f"device: {name}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy bandwidth (measured, read + write): {copy / 1e9:.1f} GB/s")
    if device.type != "cuda":
        print("no CUDA: small shapes, Triton in its interpreter; the times below are a smoke check only")
    print()
    print("| " + " | ".join(COLUMNS) + " |")
    print("| --- | --- | --- | --- |" + " ---: |" * (len(COLUMNS) - 4))
    for dname, dtype in DTYPES.items() if device.type == "cuda" else [("fp32", torch.float32)]:
        for row in cases(dtype, device):
            results, reason = [], skip_reason(row.numel, dtype, free_bytes(device))
            if reason is None:
                try:
                    results = measure(row.build(), time_fn)
                except torch.cuda.OutOfMemoryError:  # the estimate fell short
                    reason = "out of memory"
            if reason is not None:
                print(note_row(row, dname, reason), flush=True)
            for pass_, nbytes, t, diff in results:
                rate = nbytes / t["triton"]
                cells = [row.kernel, row.shape, dname, pass_, f"{t['triton'] * 1e6:.4g}", f"{rate / 1e9:.4g}",
                         f"{100 * rate / copy:.3g}", f"{t['eager'] / t['triton']:.3g}",
                         f"{t['compile'] / t['triton']:.3g}", f"{diff:.1e}"]
                print("| " + " | ".join(cells) + " |", flush=True)
            results = None
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
