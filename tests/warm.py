"""Warm starts for the commands the tests run: a server that imported torch and tpzoo once forks each command.

Most of the suite's CPU time went into starting Python processes: a tiny pretrain.py run imports torch,
torch.distributed's tensor, checkpoint and pipelining code and tpzoo for 6-7 s of CPU (2 cores, 2026-11-27: 6.6 s
on average over the first 56 commands of the suite, most of it imports), then trains for about one, and an
8-rank torchrun journey does that eight times over. With ``TPZOO_WARM_SOCKET`` set (``start``, called by
tests/conftest.py), a Python process that starts one of the ``COMMANDS`` (``python pretrain.py ...``, ``python
-m tpzoo.convert ...``, torchrun and its workers) hands itself to the server in its first milliseconds
(tests/warm_site/sitecustomize.py): the server forks a child that takes the process's argv, environment, working
directory, priority and standard streams and runs the command as ``python`` would (``runpy``); the process waits,
passes on the signals it gets, and exits as the child did (its code, or the signal that ended it). The server
stops and continues the child with the process (a stop cannot be passed on) and ends it when the process is gone
(a process killed by a test takes its command down).

What a fresh interpreter would do differently is kept out: only the server's own python, with the same
``import_env`` (the variables read as modules load: torch's, triton's, LOGLEVEL, PYTHON*), and only plain ``-u``
options, are handed over; anything else starts as usual. One difference stays: every warm command has the server's
string hash seed, where fresh processes draw one each (code whose ranks disagreed on a set's order would pass
here). ``TPZOO_WARM=0`` starts every command fresh.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from warm_site.sitecustomize import import_env

SITE = Path(__file__).with_name("warm_site")
PRELOAD = ("torch", "tpzoo.training.setup", "tpzoo.training.loop", "tpzoo.training.finetune_setup",
           "tpzoo.training.finetune_loop", "tpzoo.checkpoint", "tpzoo.convert")


def start(env: dict[str, str], preload: tuple[str, ...] = PRELOAD) -> subprocess.Popen | None:
    """The server, importing ``preload``, started for ``env`` (the session's environment, which gets
    ``TPZOO_WARM_SOCKET`` and this folder's sitecustomize on PYTHONPATH so that the commands started from it find
    the server); None when ``TPZOO_WARM=0``."""
    if env.get("TPZOO_WARM") == "0":
        return None
    path = os.path.join(tempfile.mkdtemp(prefix="tpzoo-warm-"), "socket")
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    env["TPZOO_WARM_PYTHON"] = sys.executable
    env["TPZOO_WARM_ENV"] = json.dumps(import_env(env))
    server_env = {**env, "OMP_WAIT_POLICY": "PASSIVE"}  # pretrain.py's, set before OpenMP loads
    server = subprocess.Popen([sys.executable, __file__, path, *preload], env=server_env, stdin=subprocess.DEVNULL)
    env["TPZOO_WARM_SOCKET"] = path  # listening once its imports are done: a command started before starts fresh
    return server


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request (length-prefixed JSON) and the three standard streams' descriptors sent with it."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    size = int.from_bytes(data[:8], "big")
    while len(data) < 8 + size:
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("the client left")
        data += more
    return json.loads(data[8:8 + size]), fds


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the client's process, run its command, exit as Python would."""
    os.setsid()  # a session of its own, like the client's: its autogroup priority below
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
    if request["autogroup"] is not None:
        try:
            Path("/proc/self/autogroup").write_text(str(request["autogroup"]))
        except OSError:
            pass
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=stream.isatty(), write_through=unbuffered or stream is sys.stderr)

    code: object = 0
    try:
        if request["module"]:
            sys.argv = ["-m", *request["args"]]
            sys.path[0] = request["cwd"]
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [request["target"], *request["args"]]
            sys.path[0] = os.path.dirname(os.path.abspath(request["target"]))
            runpy.run_path(request["target"], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - printed as Python prints an uncaught exception
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()  # the non-daemon threads, as at an interpreter's exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T for stopped ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Command:
    """A forked command: its connection to the client (None once the client left) and the client's pid."""

    def __init__(self, conn: socket.socket, client: int) -> None:
        self.conn: socket.socket | None = conn
        self.client = client
        self.stopped = False

    def follow(self, pid: int) -> None:
        """Stopped (SIGSTOP, SIGTSTP) while its client is, continued with it (a stop cannot be passed on)."""
        stopped = _state(self.client) in ("T", "t")
        if stopped != self.stopped:
            self.stopped = stopped
            os.kill(pid, signal.SIGSTOP if stopped else signal.SIGCONT)


def serve(path: str, preload: list[str]) -> None:
    """Import ``preload``, then listen at ``path``: fork each request's command, end a command whose client left,
    stop and continue it with its client, and send each client its command's exit status."""
    for name in preload:
        importlib.import_module(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # ready
    commands: dict[int, Command] = {}
    while os.getppid() == parent:  # pytest gone: so is the server
        conns = {c.conn: pid for pid, c in commands.items() if c.conn is not None}
        readable, _, _ = select.select([listener, *conns], [], [], 0.1)
        for ready in readable:
            if ready is not listener:  # a client sends nothing after its request: it left
                if not ready.recv(1):
                    commands[conns[ready]].conn = None
                    ready.close()
                    os.kill(conns[ready], signal.SIGKILL)
                continue
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                _child(request, fds)
            for fd in fds:
                os.close(fd)
            commands[pid] = Command(conn, request["pid"])
            conn.sendall(f"{pid}\n".encode())
        for pid, command in commands.items():
            command.follow(pid)
        while commands:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            command = commands.pop(pid, None)
            if command is not None and command.conn is not None:
                try:
                    command.conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                command.conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
