"""Every kernel of tpzoo.kernels with backend="triton" on the device against float64: the CPU kernel
tests (tests/kernels/, their cases and oracles; forward and backward; float32, bf16 and fp16
inputs) run in a pytest subprocess, with compiled Triton and the ``on_cuda`` plugin on a GPU
(see conftest.py for why a subprocess), with Triton's interpreter on the CPU."""

from __future__ import annotations

import re

import pytest
from doc_helpers import ROOT
from gpu_helpers import DEVICE, compiled_kernels, run

# test module of tests/kernels -> the Triton kernels it compiles
MODULES = {"test_kernels_softmax.py": {"_softmax_fwd", "_softmax_bwd"},
           "test_kernels_norms.py": {"_norm_fwd", "_norm_bwd"},
           "test_kernels_gelu.py": {"_gelu_kernel"}}
TIMEOUT = 500


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.removeprefix("test_kernels_").removesuffix(".py"))
def test_triton_kernels_match_float64_on_the_device(module, tmp_path):
    cache = tmp_path / "triton-cache"
    plugin = ["-p", "on_cuda"] if DEVICE == "cuda" else []
    # a failure is one line naming its error (--tb=line), with no list of names after them (-rN) to push it out of
    # the end of the output that a failed run() shows
    done = run(["-m", "pytest", "-q", "--tb=line", "-rN", "-p", "no:cacheprovider", *plugin, f"tests/kernels/{module}",
                "-k", "triton"],
               ROOT, timeout=TIMEOUT, TRITON_CACHE_DIR=str(cache), TRITON_INTERPRET="0" if DEVICE == "cuda" else "1")
    print(done.stdout[-5000:])  # ends with the table of errors vs float64 (tests/kernels/conftest.py)
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary
    if DEVICE == "cuda":
        assert MODULES[module] <= compiled_kernels(cache), sorted(compiled_kernels(cache))
