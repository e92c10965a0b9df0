"""Warm starts for the commands the tests run: a server that imported torch and tpzoo once forks each command.

Most of the suite's CPU time went into starting Python processes: a tiny pretrain.py run imports torch,
torch.distributed's tensor, checkpoint and pipelining code and tpzoo for 6-8 s of CPU, then trains for one, and
an 8-rank torchrun journey does that nine times (measured over the whole suite, 2026-11-27). With
``TPZOO_WARM_SOCKET`` set (``start``, called by tests/conftest.py), a Python process that starts one of the
``COMMANDS`` (``python pretrain.py ...``, ``python -m tpzoo.convert ...``, a torchrun worker) hands itself to the
server in its first milliseconds (tests/warm_site/sitecustomize.py): the server forks a child that takes the
process's argv, environment, working directory, priority and standard streams and runs the command as
``python`` would (``runpy``); the process waits, passes on the signals it gets, and exits as the child did (its
code, or the signal that ended it). The child dies with it (a process killed by a test takes its command down).

What a fresh interpreter would do differently is kept out: only the server's own python, with the same
``import_env`` (the variables read as modules load: torch's, triton's, LOGLEVEL, PYTHON*), and only plain ``-u``
options, are handed over; anything else starts as usual. Set ``TPZOO_WARM=0`` to start every command fresh (the check that nothing depends on it).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from warm_site.sitecustomize import import_env

SITE = Path(__file__).with_name("warm_site")
PRELOAD = ("torch", "tpzoo.training.setup", "tpzoo.training.loop", "tpzoo.training.finetune_setup",
           "tpzoo.training.finetune_loop", "tpzoo.checkpoint", "tpzoo.convert")


def start(env: dict[str, str]) -> subprocess.Popen | None:
    """The server, started for ``env`` (the session's environment, which gets ``TPZOO_WARM_SOCKET`` and this
    folder's sitecustomize on PYTHONPATH so that the commands started from it find the server); None when
    ``TPZOO_WARM=0``."""
    if env.get("TPZOO_WARM") == "0":
        return None
    path = os.path.join(tempfile.mkdtemp(prefix="tpzoo-warm-"), "socket")
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    env["TPZOO_WARM_PYTHON"] = sys.executable
    env["TPZOO_WARM_ENV"] = json.dumps(import_env(env))
    server_env = {**env, "OMP_WAIT_POLICY": "PASSIVE"}  # pretrain.py's, set before OpenMP loads
    server = subprocess.Popen([sys.executable, __file__, path], env=server_env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the warm-start server did not start (exit status {server.poll()})")
        time.sleep(0.05)
    env["TPZOO_WARM_SOCKET"] = path
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


def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
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

    def watch() -> None:  # the client gone (killed, or done): so is this command
        try:
            conn.recv(1)
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
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


def serve(path: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # ready
    listener.settimeout(0.1)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # pytest gone: so is the server
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            conn = None
        if conn is not None:
            conn.settimeout(None)
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                _child(conn, request, fds)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.sendall(f"{pid}\n".encode())
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            done = children.pop(pid, None)
            if done is not None:
                try:
                    done.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                done.close()


if __name__ == "__main__":
    serve(sys.argv[1])
