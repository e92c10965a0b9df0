"""The test tiers (tests/tiers.py) on a small suite of their own, run by pytest in a subprocess: ``-m unit`` selects
the unit tests only, a function's tier wins over its module's, a test without a tier stops the collection, a unit
test that starts a process (in the test or in a fixture, also where the error is caught) fails naming the tier to
take, and the same test marked journey passes; a process started in another thread (a background fixture's job)
or by Triton's compiler (ptxas, on a GPU) is no concern of the test in the foreground."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tier("journey")

TESTS = Path(__file__).resolve().parent
CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from tiers import pytest_collection_modifyitems, pytest_configure, pytest_runtest_call, pytest_runtest_setup
"""
MODULE = """
import subprocess, sys
import pytest

pytestmark = pytest.mark.tier("distributed")

@pytest.fixture
def started():
    subprocess.run([sys.executable, "-c", "pass"])

def test_heavy():
    pass

@pytest.mark.tier("unit")
def test_light():
    pass

@pytest.mark.tier("unit")
def test_light_starts_a_command():
    try:
        subprocess.run([sys.executable, "-c", "pass"])
    except RuntimeError:
        pass  # caught: the test fails all the same

@pytest.mark.tier("unit")
def test_light_fixture_starts_a_command(started):
    pass

@pytest.mark.tier("unit")
def test_light_while_a_thread_starts_a_command():  # a background fixture's job, beside the test
    import threading
    job = threading.Thread(target=subprocess.run, args=([sys.executable, "-c", "pass"],))
    job.start()
    job.join()

@pytest.mark.tier("unit")
def test_light_compiles_a_kernel():  # on a GPU, Triton's compiler runs ptxas: code of triton's package starts it
    import importlib.util, os
    folder = importlib.util.find_spec("triton").submodule_search_locations[0]
    code = compile("subprocess.run([sys.executable, '-c', 'pass'])", os.path.join(folder, "compiler.py"), "exec")
    exec(code, {"subprocess": subprocess, "sys": sys})

@pytest.mark.tier("journey")
def test_journey_starts_a_command(started):
    pass
"""


def pytest_run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", *args], cwd=folder,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_suite.py").write_text(MODULE)
    return tmp_path


def test_unit_selects_the_unit_tests_and_those_that_start_processes_fail(suite):
    done = pytest_run(suite, "-m", "unit")
    assert "2 deselected" in done.stdout, done.stdout
    assert "PASSED test_suite.py::test_light\n" in done.stdout
    assert "PASSED test_suite.py::test_light_while_a_thread_starts_a_command" in done.stdout
    assert "PASSED test_suite.py::test_light_compiles_a_kernel" in done.stdout
    for name in ("test_light_starts_a_command", "test_light_fixture_starts_a_command"):
        assert f"test_suite.py::{name} is a unit test but started the command" in done.stdout, done.stdout
        assert f"FAILED test_suite.py::{name}" in done.stdout or f"ERROR test_suite.py::{name}" in done.stdout
    assert "mark it @pytest.mark.tier('distributed') (ranks, workers) or 'journey' (commands)" in done.stdout


def test_other_tiers_start_what_they_need(suite):
    done = pytest_run(suite, "-m", "distributed or journey")
    assert done.returncode == 0 and "2 passed, 5 deselected" in done.stdout, done.stdout


def test_a_test_without_a_tier_stops_the_collection(suite):
    (suite / "test_untiered.py").write_text("def test_nothing():\n    pass\n")
    done = pytest_run(suite)
    assert done.returncode != 0
    assert ("test_untiered.py::test_nothing: no tier marker; give its module pytestmark = pytest.mark.tier(NAME)"
            in done.stdout + done.stderr), done.stdout + done.stderr
