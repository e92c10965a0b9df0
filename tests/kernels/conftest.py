"""Fixtures of the kernel tests: the backend under test, poisoned buffers, the block cap."""

from __future__ import annotations

import os

import pytest
import torch

from kernel_checks import OBSERVED

from tpzoo.kernels import launch

def poisoned_empty(shape, dtype, device):
    """Stands in for launch.new_empty: NaN everywhere, so an element a kernel never writes shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# (backend, block cap) of a test taking both fixtures: the cap is Triton's (launch.MAX_BLOCK), which the torch
# backend never reads, so torch runs once; Triton with the default cap, then with 16 elements so that rows loop
PATHS = {"triton-one-block": ("triton", None), "triton-looped": ("triton", 16), "torch-one-block": ("torch", None)}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test runs on both backends (``backend``); one that takes ``max_block`` too, on ``PATHS`` (unless the
    test parametrizes them itself)."""
    given = {name.strip() for mark in metafunc.definition.iter_markers("parametrize")
             for name in (mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0])}
    if "max_block" in metafunc.fixturenames and not given & {"backend", "max_block"}:
        metafunc.parametrize(("backend", "max_block"), list(PATHS.values()), ids=list(PATHS), indirect=True)
    elif "backend" in metafunc.fixturenames and "backend" not in given:
        metafunc.parametrize("backend", ["triton", "torch"], indirect=True)


@pytest.fixture
def backend(request, monkeypatch):
    """The backend under test; Triton (the interpreter here) writes into poisoned buffers."""
    monkeypatch.setenv("TPZOO_KERNELS", request.param)
    monkeypatch.setattr(launch, "new_empty", poisoned_empty)
    return request.param


@pytest.fixture
def max_block(request, monkeypatch):
    """The block cap: the default, or a smaller one (``PATHS``) under which rows take the looped paths."""
    if request.param is not None:
        monkeypatch.setattr(launch, "MAX_BLOCK", request.param)
    return request.param or launch.MAX_BLOCK


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs each run; the seed is printed with a failure (TPZOO_TEST_SEED=N repeats it)."""
    seed = int(os.environ.get("TPZOO_TEST_SEED", 0)) or torch.seed()
    torch.manual_seed(seed)
    print(f"TPZOO_TEST_SEED={seed}")


def pytest_terminal_summary(terminalreporter):
    """The largest relative error seen per op, backend, dtype and output (y, dx, weight/bias grads)."""
    if not OBSERVED:
        return
    write = terminalreporter.write_line
    write("")
    write("largest relative error vs float64 (max |out - ref| / max |ref|):")
    write(f"{'op':<22} {'backend':<7} {'dtype':<9} {'y':>9} {'dx':>9} {'dparams':>9}")
    for op, be, dt in sorted({k[:3] for k in OBSERVED}):
        cells = [OBSERVED.get((op, be, dt, kind)) for kind in ("y", "dx", "dparams")]
        write(f"{op:<22} {be:<7} {dt:<9} " + " ".join(f"{c:>9.2e}" if c is not None else f"{'-':>9}" for c in cells))
