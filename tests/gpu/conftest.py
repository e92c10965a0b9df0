"""The GPU suite: ``pytest -m gpu`` on a machine with a CUDA device and a CUDA build of torch.

Every test under tests/gpu/ is marked ``gpu`` here and skipped when torch.cuda.is_available() is
false, so the normal CPU run collects these tests (an import error or a typo still fails it) and
skips them. They run the user's journey on one CUDA device: pretrain.py (GPT, BERT; --bf16,
--fp16; resume), finetune.py, generation, Hugging Face conversion, every Triton kernel against
float64, a mixture of experts' grouped multiply against its loop, and the two model/kernel
benchmarks, each for a few steps of tiny models.

Triton must compile, never interpret. tests/conftest.py sets TRITON_INTERPRET=1 when this
process starts (the CPU kernel tests need it before triton is first imported), and with it set
Triton interprets even CUDA tensors. Triton reads the variable when it is imported, and
tests/kernels/conftest.py imports it during collection, so it cannot be undone in this process.
Hence nothing of the suite runs a model or a kernel in this process: every step is a subprocess
whose environment lacks TRITON_INTERPRET (``gpu_helpers.env``):

- the scripts (pretrain.py, finetune.py, python -m tpzoo.generate / tpzoo.convert, bench/*.py,
  and the helper scripts here) simply run without it;
- the kernel checks run tests/kernels/ in a pytest subprocess with TRITON_INTERPRET=0 (a value
  tests/conftest.py's setdefault keeps) and the ``on_cuda`` plugin, which makes tensors created
  without a device CUDA tensors: the same cases and float64 oracles as the CPU run, on the GPU.

The commands that run the Triton kernels get a fresh TRITON_CACHE_DIR, and the tests check that
it holds the compiled (.cubin) kernels: proof that Triton compiled for the GPU.

TPZOO_GPU_SUITE_DEVICE=cpu runs the same journey on the CPU (subprocesses see no GPU; the
kernels interpret; GPU-only checks such as MFU and compiled kernels are left out). It is only
there to check the suite itself where no GPU is at hand, and costs minutes; without that
variable and without CUDA every test here is skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_helpers import DEVICE, DEVICES, GPU_DIR, Pretrained, run


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if DEVICE not in DEVICES:
        raise pytest.UsageError(f"TPZOO_GPU_SUITE_DEVICE={DEVICE} is not one of {', '.join(DEVICES)}; unset it "
                                f"for the GPU, or set it to cpu to check the suite on the CPU")
    skip = None
    if DEVICE == "cuda" and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="GPU suite: no CUDA device (torch.cuda.is_available() is False); "
                                       "TPZOO_GPU_SUITE_DEVICE=cpu runs it on the CPU to check the suite itself")
    for item in items:
        if GPU_DIR in item.path.resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device_name(tmp_path_factory) -> str:
    """The device the subprocesses run on, as torch names it ("cpu" on the CPU)."""
    code = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
    name = run(["-c", code], tmp_path_factory.getbasetemp()).stdout.strip()
    assert (name == "cpu") == (DEVICE == "cpu"), f"the suite's device is {DEVICE} but the subprocesses see {name}"
    return name


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    """The folder the journey's commands run in (checkpoints, exports, logs)."""
    return tmp_path_factory.mktemp("gpu-journey")


@pytest.fixture(scope="session")
def demo_files(work) -> Path:
    """The demo tokenizer, corpus and sentiment task, exported with ``python -m tpzoo.data demo --export``."""
    run(["-m", "tpzoo.data", "demo", "--export", "demo_files"], work)
    return work / "demo_files"


@pytest.fixture(scope="session")
def pretrained(work) -> Pretrained:
    return Pretrained(work)
