"""Warm starts for the commands the tests run: a server that imported torch and tpzoo once forks each command.

Most of the suite's CPU time went into starting Python processes: a tiny pretrain.py run imports torch,
torch.distributed's tensor, checkpoint and pipelining code and tpzoo for 6-7 s of CPU (2 cores, 2026-11-27: 6.6 s
on average over the first 56 commands of the suite, most of it imports), then trains for about one, and an
8-rank torchrun journey does that eight times over. With ``TPZOO_WARM_SOCKET`` set (``start``, called by
tests/conftest.py when a selected test starts commands), a Python process that starts one of the commands of
tests/warm_site/sitecustomize.py (``python pretrain.py ...``, ``python -m tpzoo.convert ...``, torchrun and its
workers, bench/ scripts) hands itself to the server in its first milliseconds: the server forks a child that
takes the process's argv, environment, working directory, priority and standard streams and runs the command as
``python`` would, exiting through the interpreter's own shutdown; the process waits, passes on the signals it
gets, and exits as the child did (its code, or the signal that ended it). The server stops and continues the
child with the process (a stop cannot be passed on) and kills the child's process group when the process is gone
(a process killed by a test takes its command down).

What a fresh interpreter would do differently is kept out: only the server's own interpreter, with the same
``import_env`` (the variables read as libraries load: torch's, triton's, OpenMP's but the thread count and wait
policy, Hugging Face's, locale, LOGLEVEL, PYTHON*), and only plain ``-u`` options, are handed over; anything else
starts as usual, and so does a process given ``TPZOO_WARM=0`` (tests that walk a launcher's process tree). What stays
different: every warm command has the server's string hash seed, where fresh processes draw one each (code whose
ranks disagreed on a set's order would pass here), the imports' one-time warnings were printed once, by the
server, and OpenMP waits passively (pretrain.py's setting) in every command.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import types
from pathlib import Path

from warm_site.sitecustomize import import_env, interpreter

SITE = Path(__file__).with_name("warm_site")
SERVER = sys.modules["__main__"]  # the server's own module, kept while each command runs as its own __main__
PRELOAD = ("torch", "tpzoo.training.setup", "tpzoo.training.loop", "tpzoo.training.finetune_setup",
           "tpzoo.training.finetune_loop", "tpzoo.checkpoint", "tpzoo.convert",
           # what a run imports as it starts (its metrics writers, data sets, model family): 1 s a pretrain.py run,
           # 2 s a finetune.py run (datasets), measured on 2 cores
           "torch.utils.tensorboard", "torch.distributed.checkpoint._fsspec_filesystem", "sentencepiece", "datasets",
           "tpzoo.data.gpt_dataset", "tpzoo.data.bert_dataset", "tpzoo.data.blended", "tpzoo.models.gpt",
           "tpzoo.models.bert", "tpzoo.models.llama", "tpzoo.training.args", "tpzoo.training.megatron_refused")
MAX_REQUEST = 1 << 22  # bytes: a request is argv, environment and folder


def start(env: dict[str, str], preload: tuple[str, ...] = PRELOAD) -> subprocess.Popen | None:
    """The server, importing ``preload``, started for ``env`` (the session's environment, which gets
    ``TPZOO_WARM_SOCKET`` and this folder's sitecustomize on PYTHONPATH so that the commands started from it find
    the server); it writes what it prints to ``server.log`` beside the socket. None when ``TPZOO_WARM=0``."""
    if env.get("TPZOO_WARM") == "0":
        return None
    folder = Path(tempfile.mkdtemp(prefix="tpzoo-warm-"))
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    env["TPZOO_WARM_PYTHON"] = json.dumps(interpreter())
    env["TPZOO_WARM_ENV"] = json.dumps(import_env(env))
    server_env = {**env, "OMP_WAIT_POLICY": "PASSIVE"}  # pretrain.py's, set before OpenMP loads
    with open(folder / "server.log", "w") as log:
        server = subprocess.Popen([sys.executable, __file__, str(folder / "socket"), *preload], env=server_env,
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # not in pytest's group: a Ctrl-C ends the commands
    env["TPZOO_WARM_SOCKET"] = str(folder / "socket")  # listening once its imports are done: earlier, fresh starts
    return server


def stop(server: subprocess.Popen) -> None:
    """End the server, which ends the commands still running, and remove its folder."""
    server.terminate()
    server.wait(timeout=30)
    shutil.rmtree(Path(server.args[2]).parent, ignore_errors=True)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request (length-prefixed JSON) and the three standard streams' descriptors sent with it."""
    conn.settimeout(10)  # a client stopped or starved mid-request must not stall the others
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    try:
        size = int.from_bytes(data[:8], "big")
        if len(fds) != 3 or size > MAX_REQUEST:
            raise ValueError(f"a request of {size} bytes with {len(fds)} descriptors")
        while len(data) < 8 + size:
            more = conn.recv(1 << 16)
            if not more:
                raise ConnectionError("the client left")
            data += more
        conn.settimeout(None)
        return json.loads(data[8:8 + size]), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _stdio(fd: int, unbuffered: bool, like: io.TextIOWrapper) -> io.TextIOWrapper:
    """Standard stream ``fd`` as CPython makes it: raw under -u (PYTHONUNBUFFERED), else stderr and terminals by
    line."""
    binary = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
    return io.TextIOWrapper(binary, like.encoding, like.errors, newline="\n", write_through=unbuffered,
                            line_buffering=not unbuffered and (fd == 2 or binary.isatty()))


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the client's process and run its command; its SystemExit or exception ends
    the interpreter as it ends ``python``'s."""
    os.setsid()  # a group of its own, which the server ends with the client
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    with contextlib.suppress(OSError):  # a priority above the server's takes privileges
        os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
    if request["autogroup"] is not None:
        with contextlib.suppress(OSError):
            Path("/proc/self/autogroup").write_text(str(request["autogroup"]))
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = _stdio(1, unbuffered, sys.stdout)
    sys.stderr = sys.__stderr__ = _stdio(2, unbuffered, sys.stderr)
    target = request["target"]
    main = sys.modules["__main__"] = types.ModuleType("__main__")  # the command's, not the server's
    main.__builtins__ = __builtins__
    if request["module"]:
        sys.argv = ["-m", *request["args"]]
        sys.path[0] = request["cwd"]
        sys.modules.pop(target, None)  # a preloaded module runs again, as __main__
        runpy._run_module_as_main(target)
        return
    path = os.path.abspath(target)
    sys.argv = [target, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    main.__file__ = path
    try:
        source = Path(path).read_bytes()
    except OSError as e:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}", file=sys.stderr)
        sys.exit(2)
    exec(compile(source, path, "exec"), main.__dict__)


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T for stopped ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class Command:
    """A forked command (``pid``, which leads its process group): its connection to the client (None once the
    client left) and the client's pid."""

    def __init__(self, pid: int, conn: socket.socket, client: int) -> None:
        self.pid, self.conn, self.client = pid, conn, client
        self.stopped = False

    def follow(self) -> None:
        """Stopped (SIGSTOP, SIGTSTP) while its client is, continued with it."""
        stopped = _state(self.client) == "T"
        if stopped != self.stopped:
            self.stopped = stopped
            _signal_group(self.pid, signal.SIGSTOP if stopped else signal.SIGCONT)

    def left(self) -> None:
        """The client is gone: so is the command."""
        self.conn.close()
        self.conn = None
        _signal_group(self.pid, signal.SIGKILL)

    def tell(self, message: str) -> None:
        """Send the client a line (the command's pid, then its exit status); a client gone: ``left``."""
        try:
            self.conn.sendall(f"{message}\n".encode())
        except OSError:
            self.left()


def serve(path: str, preload: list[str]) -> None:
    """Import ``preload``, then listen at ``path``: fork each request's command, stop and continue it with its
    client, end it when the client leaves, and send each client its command's exit status."""
    for name in preload:
        importlib.import_module(name)
    sys.stdout.flush(), sys.stderr.flush()  # nothing of the server's in a command's output
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # ready
    commands: dict[int, Command] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while os.getppid() == parent:  # pytest gone: so is the server
            open_conns = {c.conn: c for c in commands.values() if c.conn is not None}
            readable, _, _ = select.select([listener, *open_conns], [], [], 0.1)
            for ready in readable:
                if ready is not listener:  # a client sends nothing after its request: it left
                    with contextlib.suppress(OSError):
                        if ready.recv(1):
                            continue
                    open_conns[ready].left()
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
                    for held in [conn, *open_conns]:  # other clients' ends: theirs to close
                        held.close()
                    commands.clear()  # the server's to end, not this command's
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    _child(request, fds)
                    sys.exit(0)
                for fd in fds:
                    os.close(fd)
                commands[pid] = Command(pid, conn, request["pid"])
                commands[pid].tell(str(pid))
            for command in commands.values():
                if command.conn is not None:
                    command.follow()
            while commands:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                command = commands.pop(pid, None)
                if command is not None and command.conn is not None:
                    command.tell(str(os.waitstatus_to_exitcode(status)))
                    if command.conn is not None:
                        command.conn.close()
    finally:
        for pid in commands:
            _signal_group(pid, signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
