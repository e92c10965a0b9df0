"""The client half of tests/warm.py: a command the tests start hands itself to the warm-start server.

Runs at every interpreter start under the tests (this folder is on PYTHONPATH there); does nothing unless
``TPZOO_WARM_SOCKET`` is set, ``TPZOO_WARM`` is not 0 and the process runs one of the commands below the way the
server can (the server's interpreter, the same ``import_env``, no option but -u). Anything that goes wrong before
the server has forked the command leaves the process to start as usual. Standard library only, imported after
the cheap checks: it costs a Python start, not a torch import.
"""

import os
import sys

COMMANDS = ("pretrain.py", "finetune.py", "pretrain_gpt.py", "pretrain_bert.py", "torchrun")  # scripts, by name
BENCH = "bench"  # and the benchmarks: the scripts in a folder of this name
MODULES = ("tpzoo.", "torch.distributed.run")  # python -m ...
# read as libraries load (torch's and triton's settings, OpenMP's and the BLAS', Hugging Face's caches and offline
# switches, the locale, logging levels, the interpreter's): a command whose values differ from the server's starts
# fresh. Not compared: what is read later
# (torchrun's settings for its workers, the OpenMP thread count, which the command sets) and OpenMP's wait policy
# (the server's is pretrain.py's, passive: only speed differs).
IMPORT_ENV = ("TORCH", "TRITON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "HF_", "LANG", "LC_", "TZ",
              "LOGLEVEL", "PYTHON")
RUN_ENV = ("TORCHELASTIC_", "TORCH_NCCL_", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "PYTHONUNBUFFERED")
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")


def import_env(environ):
    """The variables of ``environ`` that the imports read (``IMPORT_ENV``)."""
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_ENV) and not k.startswith(RUN_ENV)}


def interpreter():
    """This interpreter: its environment (prefix) and binary (``python`` and ``python3`` of a venv are one)."""
    return [sys.prefix, os.path.realpath(sys.executable)]


def _request():
    """(whether a module, the script or module, its arguments, whether -u) of this process's command line, or
    None for a command the server does not take."""
    argv = sys.orig_argv
    options = []
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c", "-"):
        options.append(argv[i])
        i += 1
    if set(options) - {"-u"} or i >= len(argv) or argv[i] in ("-c", "-"):
        return None
    if argv[i] == "-m":
        if i + 1 >= len(argv) or not argv[i + 1].startswith(MODULES):
            return None
        return True, argv[i + 1], argv[i + 2:], bool(options)
    script = os.path.abspath(argv[i])
    if os.path.basename(script) not in COMMANDS and os.path.basename(os.path.dirname(script)) != BENCH:
        return None
    return False, argv[i], argv[i + 1:], bool(options)


def _handover(path, found):
    """Send the command to the server at ``path`` and end as it ends; return (start as usual) when the server
    cannot take it."""
    import json
    import signal
    import socket

    if json.loads(os.environ.get("TPZOO_WARM_PYTHON", "null")) != interpreter():
        return
    if import_env(os.environ) != json.loads(os.environ.get("TPZOO_WARM_ENV", "{}")):
        return
    module, target, args, unbuffered = found
    pending, child = [], []  # signals that came before the command's pid, which they then go to

    def forward(signum, frame):
        if not child:
            pending.append(signum)
            return
        try:
            os.kill(child[0], signum)
        except OSError:
            pass

    try:
        for name in FORWARDED:
            signal.signal(getattr(signal, name), forward)
        try:
            with open("/proc/self/autogroup") as f:
                autogroup = int(f.read().split()[-1])
        except (OSError, ValueError, IndexError):
            autogroup = None
        request = json.dumps(dict(module=module, target=target, args=args, unbuffered=unbuffered, cwd=os.getcwd(),
                                  pid=os.getpid(), env=dict(os.environ), nice=os.getpriority(os.PRIO_PROCESS, 0),
                                  autogroup=autogroup)).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
        reader = conn.makefile("rb")
        child.append(int(reader.readline()))
    except Exception:  # noqa: BLE001 - no server, or it refused the request: the command starts here
        for name in FORWARDED:
            signal.signal(getattr(signal, name), signal.SIG_DFL if name != "SIGINT" else signal.default_int_handler)
        for signum in pending:
            os.kill(os.getpid(), signum)
        return
    for signum in pending:
        forward(signum, None)
    line = reader.readline()
    code = int(line) if line.strip() else -signal.SIGKILL
    if code < 0:  # ended by a signal: so is this process
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is not to end a process
    os._exit(code)


if os.environ.get("TPZOO_WARM_SOCKET") and os.environ.get("TPZOO_WARM") != "0":
    _found = _request()
    if _found is not None:
        _handover(os.environ["TPZOO_WARM_SOCKET"], _found)
