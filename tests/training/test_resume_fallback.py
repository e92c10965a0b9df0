"""pretrain.py with damaged checkpoints and a full disk, end to end; the disk's refusals, in one line.

Run A trains 6 iterations saving every 2; run B (beside it, same flags) gets ENOSPC while writing its
checkpoint of iteration 4 (injected into ``open``): exit 1, one line naming the folder and the error,
``latest`` still on iteration 2, which resumes; finetune.py (beside them) likewise on its one save.
Then a copy of A's save dir with one byte flipped in iteration 6's shard: ``--load`` warns that it
skipped iteration 6, resumes from 4 and logs A's losses for iterations 5 and 6; with every checkpoint
damaged, ``--load`` is one line, exit 2; with ``latest`` garbage, ``--load`` warns that it loads the newest
folder. A full disk under metrics.jsonl is one line, exit 1. Up front (exit 2): an output folder on a read-only
file system or not writable; a --save folder holding a file where a checkpoint's folder goes. torch's report of a
shard write that came up short ("unexpected pos") is a write error naming the disk.
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

from tpzoo.checkpoint.save import FULL_BYTES, _os_error
from tpzoo.training.args import check_output_folder, check_save_folder

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
        raise OSError(errno.ENOSPC, "No space left on device", str(file))
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
    line = ("pretrain.py: error: cannot write checkpoint full/iter_0000004: [Errno 28] No space left on device "
            "(full/iter_0000004.partial/")
    assert err.splitlines()[-1].startswith(line) and "Traceback" not in err, err[-3000:]
    assert "; full/latest still names iter_0000002 (free space" in err.splitlines()[-1]
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

    for text in ("garbage\n", ""):  # latest garbled or empty: the newest intact folder, said
        shutil.copytree(tmp_path / "whole", tmp_path / "garbled", dirs_exist_ok=True)
        (tmp_path / "garbled" / "latest").write_text(text)
        code, out, err = _finish(_start([sys.executable, "-m", "tpzoo.generate", "--load", "garbled", "--prompt",
                                         "the cat", "--max-new-tokens", "2"], tmp_path))
        assert code == 0, err[-3000:]
        said = f"garbled: loading iter_0000006 (skipped latest names {text.strip()!r}, not an iter_NNNNNNN folder)"
        assert said in err, err[-3000:]


def test_a_full_disk_under_the_metrics_is_one_line(tmp_path):
    done = subprocess.run(full_disk(PRETRAIN, "metrics.jsonl", [*FLAGS, "--save", "run"]), cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "pretrain.py: error: cannot write run/metrics.jsonl: [Errno 28] No space left on device; free space or fix "
        "the folder's permissions, or pass another --save or --log-dir"), done.stderr[-3000:]


@pytest.mark.tier("unit")
@pytest.mark.parametrize("read_only", [True, False], ids=["read-only-file-system", "not-writable"])
def test_an_output_folder_that_cannot_be_written_is_refused_up_front(tmp_path, monkeypatch, read_only):
    """(root writes anywhere on a writable file system, so the refusals are shown with os.access saying no)"""
    monkeypatch.setattr("os.access", lambda path, mode: Path(path) != tmp_path)
    flags = __import__("os").statvfs(tmp_path).f_flag | (__import__("os").ST_RDONLY if read_only else 0)
    monkeypatch.setattr("os.statvfs", lambda path: type("S", (), {"f_flag": flags})())
    why = "is on a read-only file system" if read_only else "is not writable"
    with pytest.raises(ValueError, match=rf"^--log-dir {tmp_path}/logs: {tmp_path} {why}; choose a folder you can "
                                         r"write$"):
        check_output_folder("--log-dir", tmp_path / "logs")


@pytest.mark.tier("unit")
def test_a_save_folder_holding_a_file_where_a_checkpoint_goes_is_refused(tmp_path):
    (tmp_path / "iter_0000040").write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match=rf"^--save {tmp_path}: {tmp_path}/iter_0000040 is a file, where a "
                                         r"checkpoint's folder goes; move it away or choose another --save$"):
        check_save_folder(tmp_path)
    (tmp_path / "iter_0000040").unlink()
    (tmp_path / "latest").mkdir()
    with pytest.raises(ValueError, match=r"latest is a folder, where a checkpoint's name goes"):
        check_save_folder(tmp_path)


@pytest.mark.tier("unit")
@pytest.mark.parametrize("free, said", [(1 << 20, "[Errno 28] No space left on device (1,048,576 bytes free)"),
                                        (FULL_BYTES * 2, f"[Errno 5] a write came up short ({FULL_BYTES * 2:,} "
                                                         f"bytes free)")])
def test_a_shard_write_that_came_up_short_is_a_write_error(tmp_path, monkeypatch, free, said):
    """torch's archive writer says "unexpected pos" when the disk fills under it: the disk is named."""
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("U", (), {"free": free})())
    error = _os_error(RuntimeError("[enforce fail at inline_container.cc:858] . unexpected pos 704 vs 598"),
                      tmp_path / "iter_0000004")
    assert isinstance(error, OSError) and f"[Errno {error.errno}] {error.strerror}" == said


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
