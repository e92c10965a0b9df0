"""Compile every Triton kernel variant the ops launch for a CUDA target, with no GPU present.

    python tests/aot_compile.py 90 80     # compute capabilities; prints one line per kernel compiled

The real host code runs on CPU tensors with TRITON_INTERPRET=0, so each @triton.jit kernel
goes through Triton's full compiler (TTIR -> PTX -> cubin via ptxas), which the interpreter
never exercises. A fake driver supplies the target; JITFunction.run is wrapped to compile
without launching, so outputs are garbage and only compilation is checked.
"""

import os
import sys
from contextlib import contextmanager
from typing import Iterator

os.environ["TRITON_INTERPRET"] = "0"  # real compiled kernels
os.environ["TPZOO_KERNELS"] = "triton"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class CompileOnlyDriver:
    """Just enough of a Triton driver to pick a target; nothing is ever launched. Triton caches the
    target per device id, so each capability is its own device: sm_80 and sm_90 really compile apart."""

    def __init__(self, capability: int) -> None:
        self.target = GPUTarget("cuda", capability, 32)
        self.capability = capability

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return self.capability

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextmanager
def compiling_for(capability: int) -> Iterator[list[str]]:
    """Within it, every Triton launch compiles for sm_<capability> and launches nothing; yields the list
    that gets one line per kernel compiled: "sm_<arch of the cubin> <kernel> <n> bytes of cubin"."""
    from tpzoo.kernels import dispatch

    dispatch._use_interpreter = lambda: None  # CPU tensors, yet the real compiler
    driver.set_active(CompileOnlyDriver(capability))
    seen: list[str] = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        seen.append(f"sm_{kernel.metadata.target.arch} {self.__name__} {len(kernel.asm['cubin'])} bytes of cubin")
        return kernel

    JITFunction.run = compile_only
    try:
        yield seen
    finally:
        JITFunction.run = run


def compile_all(capability: int) -> list[str]:
    from tpzoo import kernels as K
    from tpzoo.kernels import launch

    with compiling_for(capability) as seen:
        _launch_every_variant(K, launch)
    return seen


def _launch_every_variant(K, launch) -> None:
    """Forward and backward of every op (``K``: tpzoo.kernels) in float32 and bf16, under three block caps
    (``launch.MAX_BLOCK``): several rows per tile (40-wide rows in blocks of 64), one row of one block,
    then the looped paths."""
    for max_block in (8192, 64, 16):
        launch.MAX_BLOCK = max_block
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(2, 2, 8, 40, dtype=dtype, requires_grad=True)
            h = torch.randn(6, 40, dtype=dtype, requires_grad=True)
            w = torch.randn(40, dtype=dtype, requires_grad=True)
            outs = [
                K.scaled_masked_softmax(x, torch.zeros(2, 1, 1, 40, dtype=torch.bool), 0.5),
                K.scaled_masked_softmax(x, None, 0.5),
                K.scaled_causal_softmax(x, 0.5),
                K.layer_norm(h, w, w, 1e-5),
                K.layer_norm(h, w, None, 1e-5),
                K.rms_norm(h, w, 1e-6),
                K.gelu(h, "none"),
                K.gelu(h, "tanh"),
                K.bias_gelu(h, w, "none"),
                K.bias_gelu(h, w, "tanh"),
            ]
            for y in outs:
                y.backward(torch.ones_like(y))


if __name__ == "__main__":
    for cap in sys.argv[1:] or ["90"]:
        print("\n".join(compile_all(int(cap))))
