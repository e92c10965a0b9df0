"""The client half of tests/warm.py: a command the tests start hands itself to the warm-start server.

Runs at every interpreter start under the tests (this folder is on PYTHONPATH there); does nothing unless
``TPZOO_WARM_SOCKET`` is set and the process runs one of ``COMMANDS`` the way the server can (same python, the
same ``import_env``, no option but -u). Standard library only: it costs a Python start, not a torch import.
"""

import os
import sys

COMMANDS = ("pretrain.py", "finetune.py", "pretrain_gpt.py", "pretrain_bert.py", "torchrun")  # scripts, by name
BENCH = "bench"  # and the benchmarks: the scripts in a folder of this name
MODULES = ("tpzoo.", "torch.distributed.run")  # python -m ...
# read as modules load (torch's and triton's settings, logging levels, the interpreter's): a command whose values
# differ from the server's starts fresh; torchrun's own settings for its workers are read later
IMPORT_ENV = ("TORCH", "TRITON", "LOGLEVEL", "PYTHON")
RUN_ENV = ("TORCHELASTIC_", "TORCH_NCCL_", "PYTHONUNBUFFERED")


def import_env(environ):
    """The variables of ``environ`` that the imports read (``IMPORT_ENV``)."""
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_ENV) and not k.startswith(RUN_ENV)}


def _request():
    """(module or script, its name, its arguments, -u given) of this process, or None when it is not handed over."""
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


def _handover(path):
    import json
    import signal
    import socket

    if sys.executable != os.environ.get("TPZOO_WARM_PYTHON"):
        return
    if import_env(os.environ) != json.loads(os.environ.get("TPZOO_WARM_ENV", "{}")):
        return
    found = _request()
    if found is None:
        return
    module, target, args, unbuffered = found
    try:
        autogroup = int(open("/proc/self/autogroup").read().split()[-1])
    except (OSError, ValueError, IndexError):
        autogroup = None
    request = json.dumps(dict(module=module, target=target, args=args, unbuffered=unbuffered, cwd=os.getcwd(),
                              pid=os.getpid(),
                              env=dict(os.environ), nice=os.getpriority(os.PRIO_PROCESS, 0),
                              autogroup=autogroup)).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        return  # no server (the session ended): start as usual
    socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
    reader = conn.makefile("rb")
    child = int(reader.readline())

    def forward(signum, frame):
        try:
            os.kill(child, signum)
        except OSError:
            pass

    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM"):
        signal.signal(getattr(signal, name), forward)
    line = reader.readline()
    code = int(line) if line else -signal.SIGKILL
    if code < 0:  # ended by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if os.environ.get("TPZOO_WARM_SOCKET"):
    _handover(os.environ["TPZOO_WARM_SOCKET"])
