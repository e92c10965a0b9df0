"""The test tiers: every test is exactly one of

    unit         one process: no ranks, no commands; ``pytest -m unit`` is the inner loop (under 3 minutes)
    distributed  gloo ranks (``tpzoo.testing.spawn``) or worker processes, in process
    journey      the commands end to end (pretrain.py, finetune.py, python -m tpzoo..., bench/*.py as a user runs them)
    gpu          the GPU suite (tests/gpu/, marked by its conftest)

A module says its tier once, ``pytestmark = pytest.mark.tier("distributed")``, and a test that differs says its
own, ``@pytest.mark.tier("unit")`` (the nearest wins); the conftest turns it into the marker ``-m`` selects.
A test with no tier stops the collection, and a unit test that starts a process fails, naming the tier to take,
so the unit tier stays one process and fast by construction. tests/conftest.py takes the hooks below.
"""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing.process
import os
import subprocess
import sys
import threading
from typing import Any, Iterator, NoReturn

import background
import pytest

TIERS = ("unit", "distributed", "journey", "gpu")
MARKERS = [f"{t}: the {t} tier (tests/tiers.py)" for t in TIERS] + [
    "tier(name): the test's tier, one of unit, distributed, journey, gpu (tests/tiers.py)"]


def tier_of(item: pytest.Item) -> str:
    """The item's tier: gpu where the GPU suite's conftest marked it, else its nearest ``tier`` marker."""
    if item.get_closest_marker("gpu"):
        return "gpu"
    mark = item.get_closest_marker("tier")
    if mark is None or len(mark.args) != 1 or mark.args[0] not in TIERS[:-1]:
        found = "no tier marker" if mark is None else f"tier{mark.args}"
        raise pytest.UsageError(f"{item.nodeid}: {found}; give its module pytestmark = pytest.mark.tier(NAME) or "
                                f"the test @pytest.mark.tier(NAME), NAME one of unit, distributed, journey "
                                f"(tests/tiers.py)")
    return mark.args[0]


def mark_tiers(items: list[pytest.Item], heavy_fixtures: set[tuple[str, str]]) -> None:
    """Add each item's tier marker; a unit test using a fixture of ``heavy_fixtures`` ((module, name): computed in
    the background, by ranks or commands) is a UsageError."""
    for item in items:
        tier = tier_of(item)
        module = getattr(getattr(item, "module", None), "__name__", None)
        heavy = [name for name in getattr(item, "fixturenames", ()) if (module, name) in heavy_fixtures]
        if tier == "unit" and heavy:
            raise pytest.UsageError(f"{item.nodeid}: tier unit, but it uses the background fixture {heavy[0]} (ranks "
                                    f"or commands); mark it distributed or journey")
        item.add_marker(getattr(pytest.mark, tier))


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)


# after tests/gpu/conftest.py marks its tests (tryfirst), before -m selects (the mark plugin, registered earlier)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_tiers(items, set(background.JOBS))


def _foreground() -> bool:
    """Whether this runs in pytest's own thread: the background fixtures' jobs (tests/background.py), which run in
    threads of their own beside the test in the foreground, start their ranks and commands whatever its tier."""
    return threading.current_thread() is threading.main_thread()


@functools.cache
def _triton_folder() -> str | None:
    spec = importlib.util.find_spec("triton")
    return os.path.join(spec.submodule_search_locations[0], "") if spec and spec.submodule_search_locations else None


def _started_by_triton() -> bool:
    """Whether the process being started comes from Triton's package: on a GPU, compiling a kernel runs ptxas and
    the C compiler of its launcher, which is part of the op under test (the kernel tests run as unit tests there,
    tests/gpu/on_cuda.py), not a command of the test's own."""
    folder, frame = _triton_folder(), sys._getframe(2)
    while folder and frame is not None:
        if frame.f_code.co_filename.startswith(folder):
            return True
        frame = frame.f_back
    return False


def unit_starts_no_process(item: pytest.Item) -> Iterator[Any]:
    """A hook wrapper (of pytest_runtest_setup and _call): in it a unit test (its fixtures' setup included) that
    starts a subprocess or a multiprocessing process in pytest's thread gets a RuntimeError, and fails even where
    that was caught."""
    if item.get_closest_marker("unit") is None:
        return (yield)
    started: list[str] = []

    def refuse(what: str) -> NoReturn:
        started.append(f"{item.nodeid} is a unit test but started {what}; mark it @pytest.mark.tier('distributed') "
                       f"(ranks, workers) or 'journey' (commands) (tests/tiers.py)")
        raise RuntimeError(started[-1])

    saved = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def popen(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if not _foreground() or _started_by_triton():
            return saved[0](self, args, *rest, **kwargs)
        refuse(f"the command {args if isinstance(args, str) else ' '.join(map(str, args))[:200]!r}")

    def start(self: multiprocessing.process.BaseProcess) -> None:
        if not _foreground():
            return saved[1](self)
        refuse(f"a process ({type(self).__name__})")

    subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = popen, start
    try:
        result = yield
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = saved
    if started:
        pytest.fail(started[0], pytrace=False)
    return result


# a unit test that starts a process fails, in its fixtures' setup or in the test
pytest_runtest_setup = pytest_runtest_call = pytest.hookimpl(wrapper=True)(unit_starts_no_process)
