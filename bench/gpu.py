"""The GPU checks in one command, on one CUDA device: the GPU suite, the kernel table and the headline model
benchmarks, each part in a time box of its own, into one results file whose figures go into docs/benchmarks.md.

    bash bench/gpu.sh --parts checks --out DIR   # on the GPU machine, from the repository root: DIR/gpu-results.md
    bash bench/gpu.sh --parts models --out DIR   # the second device call: the model benchmarks
    bash bench/gpu.sh --parts memory --out DIR   # a third (a later session's): memory per rank, LoRA
    bash bench/gpu.sh --parts experts --out DIR  # a fourth: the mixture of experts against Hugging Face's
    bash bench/gpu.sh --dry-run                  # anywhere: each part's command and time box, each checked to start

Parts (``PARTS``), in this order: ``suite`` (``pytest -m gpu``: the user's journeys and every kernel against
float64; its test files in parallel processes where pytest-xdist is installed), ``kernels`` (bench/kernel_speed.py, the
full table), ``models:<preset>`` (bench/models.py, one part per headline model of its TARGETS, tpzoo eager and
compiled against the target's reference; mixtral-1b against Hugging Face's Mixtral eager and compiled),
``memory:fsdp`` and ``memory:lora`` (bench/memory.py: docs/benchmarks.md's GPT-2 XL and llama-1b LoRA commands).
``GROUPS`` gathers them into four groups, ``checks``, ``models``, ``memory`` and ``experts``, each of whose boxes add
up to at most 540 s: one device call may run 600 s, the install comes on top (the first run on
an H100, 2026-11-26, took longer than one call for the whole: its boxes are sized from it). A part runs in a
process group of its own; at its box it is sent SIGTERM, then SIGKILL, so a slow part costs its box and no more.
Its output streams to DIR/<part>.log and its end (the tables) into the results file with its status (passed;
failed, exit N; timed out at N s) and wall time.

Exit status 0 when every part passed, 1 otherwise, 2 for misuse (no CUDA device without --dry-run, a part, group
or box that does not exist) before anything runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
GRACE_S = 10          # between SIGTERM and SIGKILL at a part's box
TAIL_LINES = 80       # of a part's output, into the results file
GROUP_BOX_S = 540     # the most a group's boxes may add up to: a device call runs at most 600 s
# the suite's test files in parallel (each runs its commands; the GPU has room for all), where xdist is installed
XDIST = ("-n", "7", "--dist", "loadfile") if importlib.util.find_spec("xdist") else ()


@dataclasses.dataclass(frozen=True)
class Part:
    """One check: ``command`` (run from the repository root) killed after ``box_s`` seconds; ``probe``, a quick
    command that shows the part can start (the dry run's check)."""

    name: str
    command: tuple[str, ...]
    box_s: int
    probe: tuple[str, ...]


def _models(preset: str, reference: str | None, box_s: int, torch_kernels: bool = False) -> Part:
    """bench/models.py on one preset: tpzoo eager and compiled, with ``torch_kernels`` also compiled with torch's
    norms and GELU in place of the Triton kernels, and the ``reference`` contenders (comma-separated)."""
    contenders = ",".join(["tpzoo", "tpzoo-compile", *["tpzoo-torch-compile"] * torch_kernels,
                           *([reference] if reference else [])])
    return Part(f"models:{preset}", (PY, "bench/models.py", "--models", preset, "--contenders", contenders,
                                     "--steps", "10", "--warmup", "3"), box_s, (PY, "bench/models.py", "--help"))


# bench/models.py's TARGETS, each against its reference (gpt2-xl has none); the boxes leave each compile its time
# (2026-11-27, H100: gpt2 69 s, bert-large 102 s, llama-1b 148 s, gpt2-xl 83 s, before the torch-kernel contender
# of the two models whose LayerNorm and GELU are Triton kernels, far off their targets)
PARTS = (
    Part("suite", (PY, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rA", "-p", "no:cacheprovider", *XDIST), 330,
         (PY, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "--collect-only", "-p", "no:cacheprovider")),
    Part("kernels", (PY, "bench/kernel_speed.py"), 200, (PY, "bench/kernel_speed.py", "--help")),
    _models("gpt2", "plain-compile", 120, torch_kernels=True),
    _models("bert-large", "hf-compile", 150, torch_kernels=True),
    _models("llama-1b", "hf-compile", 165),
    _models("gpt2-xl", None, 105),
    # a mixture of experts (the grouped multiply) against Hugging Face's Mixtral, eager and compiled: not yet measured
    _models("mixtral-1b", "hf,hf-compile", 240),
    Part("memory:fsdp", (PY, "bench/memory.py", "--preset", "gpt2-xl", "--dp", "1", "--modes", "plain", "fsdp",
                         "--recompute"), 240, (PY, "bench/memory.py", "--help")),
    Part("memory:lora", (PY, "bench/memory.py", "--preset", "llama-1b", "--dp", "1", "--modes", "plain", "lora"), 240,
         (PY, "bench/memory.py", "--help")),
)
GROUPS = {"checks": ("suite", "kernels"), "models": ("models:gpt2", "models:bert-large", "models:llama-1b",
                                                    "models:gpt2-xl"),
          "memory": ("memory:fsdp", "memory:lora"), "experts": ("models:mixtral-1b",)}
assert sorted(n for names in GROUPS.values() for n in names) == sorted(p.name for p in PARTS)
assert all(sum(p.box_s for p in PARTS if p.name in names) <= GROUP_BOX_S for names in GROUPS.values())


@dataclasses.dataclass
class Outcome:
    part: Part
    status: str            # passed | failed, exit N | timed out at N s | dry run: ... | did not start: ...
    seconds: float
    tail: str


def part_env() -> dict[str, str]:
    """The parts' environment: unbuffered output (a killed part keeps what it printed), Triton compiling (the
    suite's own subprocesses drop TRITON_INTERPRET too), no kernel backend forced from outside."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TPZOO_KERNELS")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def run_part(part: Part, log: Path, command: tuple[str, ...] | None = None, box_s: float | None = None) -> Outcome:
    """Run ``command`` (default: the part's) with its output into ``log``; at ``box_s`` (default: the part's box)
    its whole process group gets SIGTERM, then SIGKILL ``GRACE_S`` later."""
    command, box_s = command or part.command, part.box_s if box_s is None else box_s
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            proc = subprocess.Popen(command, cwd=ROOT, env=part_env(), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as e:
            return Outcome(part, f"did not start: {e}", 0.0, "")
        try:
            rc = proc.wait(timeout=box_s)
            status = "passed" if rc == 0 else f"failed, exit {rc}"
        except subprocess.TimeoutExpired:
            _kill(proc)
            status = f"timed out at {box_s:g} s"
    seconds = time.monotonic() - start
    return Outcome(part, status, seconds, "\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:]))


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's process group; SIGKILL to what is left of it after ``GRACE_S``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the leader's children too, if it left any
    proc.wait()


def environment() -> str:
    """Device, versions and commit, one line (imports torch: after the parts are checked)."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    commit = git.stdout.strip() or "unknown (no git)"
    return (f"device: {device}; torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}; "
            f"commit {commit}; {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")


def report(outcomes: list[Outcome], header: str, command: str) -> str:
    """The results file: what ran where, a table of the parts, then each part's output's end."""
    lines = [f"# GPU checks: {header}", "", f"command: `{command}`", "",
             "| part | status | seconds | box s |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {o.part.name} | {o.status} | {o.seconds:.0f} | {o.part.box_s} |" for o in outcomes]
    for o in outcomes:
        lines += ["", f"## {o.part.name}: {o.status}", "", f"`{' '.join(o.part.command)}`", ""]
        body = o.tail.strip() or "(no output)"
        # bench tables are Markdown already; the rest (pytest, tracebacks) reads as text
        lines += [body] if o.part.name != "suite" and o.status == "passed" else ["```text", body, "```"]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/gpu.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-results"),
                   help="folder for gpu-results.md and each part's log (default: ./gpu-results)")
    p.add_argument("--parts", help=f"comma-separated, of the groups {','.join(GROUPS)} (one device call each) or the "
                                   f"parts {','.join(p.name for p in PARTS)} (default: all)")
    p.add_argument("--box", action="append", default=[], metavar="PART=SECONDS",
                   help="another time box for a part (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print each part's command and box, check that each "
                   "starts (its probe), write the results file; needs no GPU")
    args = p.parse_args(argv)
    names = [part.name for part in PARTS]
    chosen = [n for given in args.parts.split(",") for n in GROUPS.get(given, (given,))] if args.parts else names
    if unknown := [n for n in chosen if n not in names]:
        p.error(f"--parts: no part {', '.join(unknown)}; choose from the groups {','.join(GROUPS)} or the parts "
                f"{','.join(names)}")
    boxes = {}
    for text in args.box:
        name, _, seconds = text.partition("=")
        if name not in names or not seconds.isdigit() or int(seconds) < 1:
            p.error(f"--box {text}: expected PART=SECONDS with PART one of {','.join(names)} and SECONDS >= 1")
        boxes[name] = int(seconds)
    args.parts = [dataclasses.replace(part, box_s=boxes.get(part.name, part.box_s)) for part in PARTS
                  if part.name in chosen]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu.sh: error: no CUDA device here (torch.cuda.is_available() is False); run it on the GPU "
              "machine, or pass --dry-run to check the parts without one", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes, probes = [], {}
    for part in args.parts:
        log = args.out / f"{part.name.replace(':', '-')}.log"
        print(f"[{part.name}] box {part.box_s} s: {' '.join(part.command)}", flush=True)
        if args.dry_run:  # each probe once (the models parts share theirs)
            probe = probes.get(part.probe) or probes.setdefault(part.probe, run_part(part, log, part.probe, box_s=120))
            outcome = dataclasses.replace(probe, part=part, status=f"dry run: starts ({' '.join(part.probe[1:])}: "
                                                        f"{probe.status})")
        else:
            outcome = run_part(part, log)
        print(f"[{part.name}] {outcome.status} after {outcome.seconds:.0f} s", flush=True)
        outcomes.append(outcome)
    results = args.out / "gpu-results.md"
    command = " ".join(["bash bench/gpu.sh", *(argv if argv is not None else sys.argv[1:])])
    results.write_text(report(outcomes, environment(), command))
    print(results.read_text().split("\n## ")[0])
    dry_ok = all(o.status.endswith("passed)") for o in outcomes)
    return 0 if (dry_ok if args.dry_run else all(o.status == "passed" for o in outcomes)) else 1


if __name__ == "__main__":
    sys.exit(main())
