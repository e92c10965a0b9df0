"""pytest plugin for the kernel tests on a GPU: ``pytest -p on_cuda tests/kernels/...`` (tests/gpu on
PYTHONPATH, TRITON_INTERPRET=0). Tensors created without a device are CUDA tensors, so the CPU
kernel tests, their cases and their float64 oracles run unchanged on the GPU with compiled Triton."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    if not torch.cuda.is_available():
        raise pytest.UsageError("-p on_cuda needs a CUDA device")
    if os.environ.get("TRITON_INTERPRET") != "0":
        raise pytest.UsageError("-p on_cuda needs TRITON_INTERPRET=0: the kernels must be compiled, not interpreted")
    torch.set_default_device("cuda")  # per thread; pytest runs the tests in this one


@pytest.fixture(autouse=True)
def new_tensors_are_cuda_tensors() -> None:
    assert torch.empty(0).is_cuda, "torch.set_default_device('cuda') is not in effect"
