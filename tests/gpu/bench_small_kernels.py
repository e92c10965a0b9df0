"""bench/kernel_speed.py's main() at the small shapes it uses without CUDA, on whatever device it picks.

    python tests/gpu/bench_small_kernels.py

On a GPU the script's own shapes (7B-class rows, softmaxes of up to 2^31 elements, a torch.compile
per case) are for the benchmark, too large for a test suite; this runs its CUDA path (do_bench
timing, the bf16 and fp32 rows, the Triton kernels compiled) at small shapes. bench/kernel_speed.py has
no flag for that, so ``cases`` is wrapped: each case of its CPU list, built on the device main() chose.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> ModuleType:
    """bench/kernel_speed.py as a module named bench_kernels (not ``kernels``: that is the repository's kernels/)."""
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernel_speed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    bench = load_bench()
    cpu_cases = bench.cases

    def small_cases(dtype: torch.dtype, device: torch.device) -> list:
        """The CPU list's rows, each built on ``device`` in place of the CPU (every case builder takes it last)."""
        return [dataclasses.replace(row, build=partial(row.build.func, *row.build.args[:-1], device))
                for row in cpu_cases(dtype, torch.device("cpu"))]

    bench.cases = small_cases
    bench.main()
