"""The package installs as documented: README's test command is CI's, and kernels/ ships as tpzoo.kernels."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.tier("journey")



ROOT = Path(__file__).resolve().parents[1]


def readme_command(heading: str) -> str:
    """The single command in the bash block under README's ``## heading``."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block under '## {heading}'"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) == 1, f"'## {heading}' should hold one command, found {lines}"
    return lines[0]


@pytest.mark.tier("unit")
def test_ci_runs_exactly_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == readme_command("Run the tests")
    assert "torch==2.13.0" in ci[-1], "CI must pin the CPU build of torch"


def source_packages() -> set[str]:
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tpzoo").rglob("__init__.py")}
    found |= {"tpzoo." + ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kernels").rglob("__init__.py")}
    return found


def test_wheel_ships_kernels_as_tpzoo_kernels_only(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    wheel = next(tmp_path.glob("tpzoo-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("kernels/")], "kernels/ must not install as a top-level module"
    packages = {os.path.dirname(n).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages == source_packages(), "pyproject's package list and the source tree disagree"

    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    probe = ("import importlib.util, tpzoo, tpzoo.kernels, tpzoo.parallel, tpzoo.training.megatron_refused; "
             "print(tpzoo.kernels.__file__); print(getattr(importlib.util.find_spec('kernels'), 'origin', None))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(site)}, timeout=120)
    assert out.returncode == 0, out.stderr
    kernels_file, top_level = out.stdout.split()
    assert kernels_file == str(site / "tpzoo" / "kernels" / "__init__.py")
    assert not_ours(top_level), top_level


def not_ours(origin: str) -> bool:
    """A top-level ``kernels`` found is none (None) or another package's (Hugging Face's hub kernels, which
    transformers 5 requires), never tpzoo's kernels/."""
    return origin == "None" or not (origin.startswith(str(ROOT / "kernels")) or "/tpzoo/kernels/" in origin)


def test_editable_install_exposes_no_top_level_kernels(tmp_path):
    probe = ("import importlib.util, tpzoo.kernels; "
             "print(tpzoo.kernels.__file__, getattr(importlib.util.find_spec('kernels'), 'origin', None))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    ours, top_level = out.stdout.split()
    assert ours == str(ROOT / "kernels" / "__init__.py") and not_ours(top_level), out.stdout
