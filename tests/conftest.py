"""Test setup shared by the whole suite.

tests/ mirrors the source tree (tests/models/ for tpzoo/models/, ...). The helper modules shared by
those folders (data_helpers, doc_helpers, hf_models, pretrain_helpers, real_text) live in tests/
itself, which is put on sys.path here, so ``from doc_helpers import ...`` works from any folder.

TRITON_INTERPRET=1 must be in the environment before any @triton.jit decorator runs, i.e.
before anything imports the Triton kernel modules: the kernel tests run on the CPU through
Triton's interpreter.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import background  # noqa: E402 - after the environment and sys.path above
import pytest  # noqa: E402
import warm  # noqa: E402
from tpzoo import testing  # noqa: E402

# the ranks of tpzoo.testing.spawn fork from a server that imported these too: each rank unpickles its test
# function, importing the test module and with it pytest and the helpers
testing.PRELOAD += ["pytest", "background", "cases", "families", "doc_helpers", "pretrain_helpers"]
from tiers import (pytest_collection_modifyitems, pytest_configure, pytest_runtest_call,  # noqa: E402, F401
                   pytest_runtest_setup)


@pytest.fixture(scope="session", autouse=True)
def background_jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Starts the ``background.fixture``s of the selected tests with the session (see tests/background.py)."""
    runner = background.Runner(background.selected(request.session.items), tmp_path_factory)
    RUNNERS.append(runner)
    yield runner
    runner.stop()


RUNNERS: list[background.Runner] = []
SERVER = pytest.StashKey["subprocess.Popen | None"]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The warm-start server of the commands (tests/warm.py), when a selected test may start one: before any
    test's setup (a unit test may start no process) and before the background jobs copy the environment."""
    if any(item.get_closest_marker("unit") is None for item in session.items):
        session.config.stash[SERVER] = warm.start(os.environ)


def pytest_sessionfinish(session: pytest.Session) -> None:
    server = session.config.stash.get(SERVER, None)
    if server is not None:
        warm.stop(server)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """With ``--durations``: each background job's own wall time (on the second core, beside the tests)."""
    if config.getoption("durations", None) is not None and RUNNERS and RUNNERS[0].seconds:
        terminalreporter.write_sep("=", "background jobs (wall time each)")
        for line in RUNNERS[0].report():
            terminalreporter.write_line(line)
