"""Heavy module fixtures computed in the background from the start of the session.

On CI's 2 cores the pytest process keeps one core busy for most tests (single-threaded checks, the
Triton interpreter) and leaves the other idle. A fixture declared with ``background.fixture`` starts
with the session instead of with its first test: the fixtures of the selected tests (``-k`` keeps
working) run one at a time, in the order their first tests come, in a thread of the pytest process,
their processes at the lowest priority (nice 19) so that they take the idle core and never slow the
test in the foreground. The fixture then hands the value to its tests, waiting for it if need be
(meanwhile the job's processes go back to nice 0, where privileges allow: ``hurry``, and a job not
started yet starts at once beside the one running), and re-raises its error in each of them.

    @background.fixture
    def runs(tmp_path_factory) -> Path:       # a module fixture, computed in the background
        root = tmp_path_factory.mktemp("runs")
        run_as_needed([...], root)
        return root

Inside one, start ranks with ``background.spawn`` (tpzoo.testing.spawn, niced) and commands with
the helpers of doc_helpers and pretrain_helpers (which take ``environ()`` and ``niced``); its only
argument is pytest's ``tmp_path_factory``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tpzoo.testing import spawn as spawn_ranks

NICE = 19
Job = Callable[[pytest.TempPathFactory], Any]
JOBS: dict[tuple[str, str], Job] = {}  # (module, fixture name) -> the function that computes it
WAITING: set[tuple[str, str]] = set()  # the jobs that mostly wait (``fixture(waits=True)``)


def fixture(job: Job | None = None, *, waits: bool = False):
    """A module fixture named like ``job`` whose value ``job(tmp_path_factory)`` is computed in the background.

    ``waits=True`` (``@background.fixture(waits=True)``): a job that mostly waits rather than computes (for a
    process group's timeout to expire on a stopped rank): it runs from the start in a thread of its own, beside
    the queue of the others and the other waiting jobs, so that its waiting overlaps their work and the
    foreground's; its processes are not niced (their timings are what it measures)."""
    if job is None:
        return lambda job: fixture(job, waits=waits)
    key = (job.__module__, job.__name__)
    JOBS[key] = job
    if waits:
        WAITING.add(key)

    @pytest.fixture(scope="module", name=job.__name__)
    def result(background_jobs: Runner):
        return background_jobs.result(key)

    return result


SESSION_ENV: dict[str, str] = {}  # os.environ as the session started
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
            "OMP_NUM_THREADS")  # what tpzoo.testing.spawn sets in a rank


def in_job() -> bool:
    """Whether this runs in a job: in a thread other than pytest's main one (the job's, or one a job started)
    once a Runner started."""
    return bool(SESSION_ENV) and threading.current_thread() is not threading.main_thread()


def environ() -> dict[str, str]:
    """The environment for a process started now: inside a job, os.environ as the session started (the
    tests in the foreground monkeypatch it meanwhile: TPZOO_KERNELS, TPZOO_CACHE, ...); else os.environ."""
    return dict(SESSION_ENV if in_job() else os.environ)


LOWER_PRIORITY = f"""
import os
if os.getsid(0) != os.getpid():
    os.setsid()  # a session of its own: under autogroup scheduling, nice only ranks processes within a session
try:
    with open("/proc/self/autogroup", "w") as f:
        f.write("{NICE}")  # the session's share against the others (pytest's)
except OSError:
    pass  # no autogroup scheduling: nice alone ranks it below the foreground
os.nice({NICE})
"""


def niced(argv: list[str]) -> list[str]:
    """``argv`` to start a process with: inside a job, at the lowest priority (``LOWER_PRIORITY``), else as is."""
    if not in_job():
        return argv
    return [sys.executable, "-c", LOWER_PRIORITY + "import sys; os.execvp(sys.argv[1], sys.argv[1:])", *argv]


def _niced(env: dict[str, str], fn: Callable, *args: Any, **kwargs: Any) -> Any:
    exec(LOWER_PRIORITY)  # the code that ``niced`` runs before a command
    rank = {k: os.environ[k] for k in RANK_ENV if k in os.environ}
    os.environ.clear()
    os.environ.update({**env, **rank})
    return fn(*args, **kwargs)


def spawn(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``tpzoo.testing.spawn(fn, world_size, *args, **kwargs)`` with every rank at the lowest priority, in the
    environment of ``environ()``."""
    return spawn_ranks(_niced, world_size, environ(), fn, *args, **kwargs)


def threads_below(pid: int) -> Iterator[tuple[int, int]]:
    """(process id, thread id) of the threads of every process descended from ``pid`` (Linux: /proc)."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in map(int, (task / "children").read_text().split()):
                with contextlib.suppress(OSError):
                    yield from ((child, int(t.name)) for t in Path(f"/proc/{child}/task").iterdir())
                yield from threads_below(child)


def hurry() -> None:
    """Nice 0 for every thread below the pytest process and for the sessions they lead (a job's, while its
    test waits). Raising a priority takes privileges: elsewhere they stay low (on CI nothing else competes
    with them then; on a machine shared with other work, that work would)."""
    for pid, tid in threads_below(os.getpid()):
        with contextlib.suppress(OSError):
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
            if pid == tid and os.getsid(pid) == pid:
                Path(f"/proc/{pid}/autogroup").write_text("0")


def selected(items: list[pytest.Item]) -> list[tuple[str, str]]:
    """The background fixtures the ``items`` use, in the order of the first item using each."""
    order: dict[tuple[str, str], None] = {}
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", None)
        for name in getattr(item, "fixturenames", ()):
            if (module, name) in JOBS:
                order.setdefault((module, name))
    return list(order)


class Runner:
    """Runs the jobs ``keys`` one after another in a daemon thread (each ``WAITING`` one in a thread of its own);
    ``result`` waits for one; an awaited job not started yet starts at once in a thread of its own, beside the job
    running, which may be one process that leaves the other core idle (a core stood idle a tenth of the suite's
    time before, vmstat on 2 cores, 2026-11-28). Jobs are not started early beyond that: at nice 19 beside the
    foreground and the queue a long job slows past its own time limits (the finetuning page's commands, started
    early so, ran past their 600 s)."""

    def __init__(self, keys: list[tuple[str, str]], tmp_path_factory: pytest.TempPathFactory) -> None:
        self.futures = {key: Future() for key in keys}
        self.seconds: dict[tuple[str, str], float] = {}  # each finished job's wall time
        self.tmp_path_factory = tmp_path_factory
        SESSION_ENV.update(os.environ)
        self.queue = [k for k in keys if k not in WAITING]  # not started yet, in order
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        if self.queue:
            self._start("background fixtures", self._next)
        for key in (k for k in keys if k in WAITING):
            self._start(f"background wait: {key[1]}", functools.partial(next, iter([key]), None))

    def _start(self, name: str, take: Callable[[], tuple[str, str] | None]) -> None:
        """A daemon thread named ``name`` computing the jobs ``take()`` gives (``_run``)."""
        thread = threading.Thread(target=self._run, args=(take,), name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _next(self) -> tuple[str, str] | None:
        """The queue's next job, taken off it (None: none left)."""
        with self.lock:
            return self.queue.pop(0) if self.queue else None

    def _run(self, take: Callable[[], tuple[str, str] | None]) -> None:
        """Compute the jobs ``take()`` gives, one after another, until it gives None."""
        while (key := take()) is not None:
            future = self.futures[key]
            if not future.set_running_or_notify_cancel():
                continue
            start = time.perf_counter()
            try:
                value = JOBS[key](self.tmp_path_factory)
            except BaseException as e:  # noqa: BLE001 - re-raised in every test that uses the fixture
                value, error = None, e
            else:
                error = None
            self.seconds[key] = time.perf_counter() - start  # before the result wakes a waiting test
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

    def result(self, key: tuple[str, str]) -> Any:
        if key not in self.futures:  # a test the session did not select at its start
            return JOBS[key](self.tmp_path_factory)
        future = self.futures[key]
        with self.lock:
            queued = key in self.queue
            if queued:
                self.queue.remove(key)
        if queued:  # not started yet: it starts now, beside the job running
            self._start(f"background now: {key[1]}", functools.partial(next, iter([key]), None))
        while not future.done():  # the foreground is idle: the jobs' processes need not yield to it
            hurry()
            wait([future], timeout=1.0)
        return future.result()

    def report(self) -> list[str]:
        """One line a finished job, slowest first: its wall time and name (for ``--durations``' reader: the
        setup times there count only a test's wait for a job, not the job)."""
        jobs = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        return [f"{s:8.1f}s  {module}::{name}" + (" (waits)" if (module, name) in WAITING else "")
                for (module, name), s in jobs]

    def stop(self) -> None:
        """Cancel the jobs not started (a session cut short); wait for the running one."""
        for future in self.futures.values():
            future.cancel()
        for thread in self.threads:
            thread.join()
