"""pretrain.py with damaged checkpoints and a full disk, end to end.

Run A trains 6 iterations saving every 2; run B (beside it, same flags) gets ENOSPC while writing its
checkpoint of iteration 4 (injected into ``open``): exit 1, one line naming the folder and the error,
``latest`` still on iteration 2, which resumes; finetune.py (beside them) likewise on its one save.
Then a copy of A's save dir with one byte flipped in iteration 6's shard: ``--load`` warns that it
skipped iteration 6, resumes from 4 and logs A's losses for iterations 5 and 6; with every checkpoint
damaged, ``--load`` is one line, exit 2.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from doc_helpers import ROOT
from families import CAUSAL_LM
from pretrain_helpers import PRETRAIN, TINY, command, env, metrics
from test_preemption import write_text_files

from tpzoo.training.args import check_output_folder

pytestmark = pytest.mark.tier("journey")



FLAGS = TINY + "--train-iters 6 --save-interval 2 --eval-interval 0".split()
SHARD = "__0_0.distcp"
OLD_CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1" / CAUSAL_LM.family
# runs the script PROGRAM with the disk full (ENOSPC on opening a file to write) inside checkpoint MARKER
FULL_DISK = """
import builtins, errno, io, runpy, sys
opened = io.open
def full(file, mode="r", *args, **kwargs):
    if {marker!r} in str(file) and set(mode) & set("wax+"):
        raise OSError(errno.ENOSPC, "No space left on device")
    return opened(file, mode, *args, **kwargs)
io.open = builtins.open = full
sys.argv[0] = {program!r}
runpy.run_path({program!r}, run_name="__main__")
"""


def full_disk(program: Path | str, marker: str, flags: list[str]) -> list[str]:
    return [sys.executable, "-c", FULL_DISK.format(program=str(program), marker=marker), *flags]


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_full_disk_then_damaged_latest_falls_back_to_the_intact_checkpoint(tmp_path):
    whole = _start(command(FLAGS + ["--save", "whole"]), tmp_path)
    full = _start(full_disk(PRETRAIN, "iter_0000004", [*FLAGS, "--save", "full"]), tmp_path)
    # finetune.py from an old checkpoint: 80 windows in batches of 8, its one save (iteration 10) fails
    finetune = _start(full_disk(ROOT / "finetune.py", "iter_0000010", [
        "--load", str(OLD_CHECKPOINT), "--tokenizer-model", str(ROOT / "tpzoo" / "data" / "demo" / "tokenizer.model"),
        *write_text_files(tmp_path), "--epochs", "1", "--global-batch-size", "8", "--micro-batch-size", "8",
        "--seq-length", "16", "--save", "finetune"]), tmp_path)
    code, _, err = _finish(full)
    assert code == 1, err[-3000:]
    line = ("pretrain.py: error: cannot write checkpoint full/iter_0000004: [Errno 28] No space left on device; "
            "full/latest still names iter_0000002")
    assert err.splitlines()[-1].startswith(line) and "Traceback" not in err, err[-3000:]
    assert (tmp_path / "full" / "latest").read_text().strip() == "iter_0000002"
    code, _, err = _finish(finetune)
    line = "finetune.py: error: cannot write checkpoint finetune/iter_0000010: [Errno 28] No space left on device"
    assert code == 1 and err.splitlines()[-1].startswith(line) and "Traceback" not in err, err[-3000:]
    code, _, err = _finish(whole)
    assert code == 0, err[-3000:]

    shutil.copytree(tmp_path / "whole", tmp_path / "damaged")
    _flip(tmp_path / "damaged" / "iter_0000006" / SHARD)
    shutil.copytree(tmp_path / "damaged", tmp_path / "ruined")  # before the resumed run writes into damaged
    resumed = _start(command(FLAGS + ["--load", "damaged", "--save", "damaged"]), tmp_path)
    for name in ("iter_0000002", "iter_0000004"):
        (tmp_path / "ruined" / name / SHARD).unlink()
    ruined = _start(command(FLAGS + ["--load", "ruined"]), tmp_path)
    code, out, err = _finish(resumed)
    assert code == 0, err[-3000:]
    skipped = f"damaged: loading iter_0000004 instead of iter_0000006 (skipped iter_0000006: damaged/iter_0000006/" \
              f"{SHARD}: sha256 differs from the manifest's (the file is corrupt))"
    assert skipped in err, err[-3000:]
    assert "resumed from damaged/iter_0000004 at iteration 4" in out, out[-3000:]
    a, b = metrics(tmp_path / "whole"), metrics(tmp_path / "damaged")
    assert [b[i]["loss"] for i in (5, 6)] == [a[i]["loss"] for i in (5, 6)], (a, b)
    assert [b[i]["grad_norm"] for i in (5, 6)] == [a[i]["grad_norm"] for i in (5, 6)]
    code, _, err = _finish(ruined)
    assert code == 2 and err.count("\n") == 1, err[-3000:]
    assert err.startswith("pretrain.py: error: ruined holds no intact checkpoint (iter_0000006: "), err
    assert f"iter_0000002: ruined/iter_0000002/{SHARD} is missing" in err, err


@pytest.mark.tier("unit")
def test_save_folder_that_cannot_be_looked_at_is_named(tmp_path, monkeypatch):
    """A folder above --save that may not be searched (stat: EACCES, not a misuse error) is named, as misuse."""
    locked = tmp_path / "locked"
    exists = Path.exists

    def denied(self: Path) -> bool:
        if locked in self.parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return exists(self)

    monkeypatch.setattr(Path, "exists", denied)
    with pytest.raises(ValueError, match=rf"^--save {locked}/run: cannot look at {locked}/run \(Permission denied\); "
                                         r"choose another path$"):
        check_output_folder("--save", locked / "run")
