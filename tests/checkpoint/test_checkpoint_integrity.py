"""Checkpoint integrity: the manifest a save writes, the check at load naming the first bad file, the
fallback of a save dir to its newest intact checkpoint, and disk errors on save.

One 2-rank spawn (dp 2, a tiny GPT) saves iterations 1 and 2; each case then damages a copy (rank 0)
and both ranks load it, sharing the hashing: every error must name the bad file, the same on both ranks.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cases import CaseLog, assert_case
from families import CAUSAL_LM
from tpzoo.checkpoint import load_checkpoint, load_model, resolve_checkpoint, save_checkpoint, wait_for_save
from tpzoo.checkpoint.manifest import MANIFEST_FILE, file_entry
from tpzoo.engine import Engine, EngineConfig
from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")



FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1" / CAUSAL_LM.family
SHARD = "__1_0.distcp"  # rank 1's shard: hashed by rank 1 at load, named on both ranks
# case -> (damage done to a copy of iter_0000002, what the error says after the copy's path)
DAMAGES = {
    "flipped-byte": (lambda f: _flip(f / SHARD), f"/{SHARD}: sha256 differs from the manifest's"),
    "truncated-shard": (lambda f: _cut(f / SHARD), f"/{SHARD} has 100 bytes, the manifest says"),
    "deleted-shard": (lambda f: (f / SHARD).unlink(), f"/{SHARD} is missing"),
    "bad-meta": (lambda f: (f / "meta.json").write_text("{not json"), "/meta.json has 9 bytes, the manifest says"),
    "truncated-metadata": (lambda f: _cut(f / ".metadata"), "/.metadata has 100 bytes, the manifest says"),
    "bad-manifest": (lambda f: (f / MANIFEST_FILE).write_text("[]"), f"/{MANIFEST_FILE} is not a tpzoo-manifest"),
    "deleted-manifest": (lambda f: (f / MANIFEST_FILE).unlink(),
                         f"/{MANIFEST_FILE} is missing although meta.json records one"),
}
# saved before manifests (no manifest, none recorded in meta.json): only what the loader reads can be
# checked, meta.json's JSON and .metadata's pickle
BARE = {
    "bad-meta-no-manifest": (lambda f: (f / "meta.json").write_text("{not json"), "/meta.json is not valid JSON"),
    "truncated-metadata-no-manifest": (lambda f: _cut(f / ".metadata"), "/.metadata is unreadable"),
}
SAVE_ERRORS = ("enospc", "eacces", "save-is-a-file", "read-only")
NAMES = [*DAMAGES, *BARE, "manifest-lists-every-file", "background-save",
         "background-part-error", "missing-manifest-loads",
         "old-checkpoint-loads", "fallback", "none-intact", "explicit-folder-no-fallback", "latest-not-utf8",
         *SAVE_ERRORS]


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def make_engine(mesh) -> Engine:
    case = CAUSAL_LM
    config = case.config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128,
                         max_position_embeddings=16)
    return Engine(lambda plan, **stage: case.build(config, plan, **stage), config,
                  EngineConfig(micro_batch_size=2, global_batch_size=4, lr=1e-3), ParallelPlan(mesh, kernels="torch"))


def step(engine: Engine, seed: int) -> float:
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(seed))
    return engine.train_step(dict(input_ids=ids, labels=torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1))).loss


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def on_rank0(action) -> None:
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def damaged_copy(root: Path, name: str, damage, bare: bool = False) -> Path:
    """A copy of iter_0000002 with ``damage`` done to it; ``bare``: first made as saved before manifests."""
    folder = root / name / "iter_0000002"

    def make() -> None:
        shutil.copytree(root / "run" / "iter_0000002", folder)
        if bare:
            (folder / MANIFEST_FILE).unlink()
            meta = json.loads((folder / "meta.json").read_text())
            meta["checkpoint"].pop("manifest", None)
            (folder / "meta.json").write_text(json.dumps(meta))
        damage(folder)

    on_rank0(make)
    return folder


def load_error(action) -> str:
    try:
        action()
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    raise AssertionError("loaded without an error")


def checks(root: str) -> CaseLog:
    log, root, warned = CaseLog(), Path(root), Warnings()
    logging.getLogger("tpzoo.checkpoint").addHandler(warned)
    mesh = init_mesh(dp=2)
    manual_seed(0, mesh)
    engine = make_engine(mesh)
    run = root / "run"
    step(engine, 0)
    save_checkpoint(run, 1, engine, meta={})
    step(engine, 1)
    save_checkpoint(run, 2, engine, meta={})
    latest = run / "iter_0000002"
    with log.case("manifest-lists-every-file"):
        files = json.loads((latest / MANIFEST_FILE).read_text())["files"]
        on_disk = sorted(p.name for p in latest.iterdir() if p.name != MANIFEST_FILE)
        assert sorted(files) == on_disk == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"], (files, on_disk)
        for name, entry in files.items():
            assert entry == file_entry(latest / name), name
    with log.case("background-save"):  # hashed and published on a thread while the engine steps on
        saved = [p.detach().clone() for p in engine.params]
        folder = save_checkpoint(root / "background", 3, engine, meta={}, background=True)
        step(engine, 2)
        assert wait_for_save() == folder and wait_for_save() is None
        assert (root / "background" / "latest").read_text().strip() == folder.name
        files = json.loads((folder / MANIFEST_FILE).read_text())["files"]
        assert sorted(files) == sorted(p.name for p in folder.iterdir() if p.name != MANIFEST_FILE), files
        assert all(entry == file_entry(folder / name) for name, entry in files.items())
        load_checkpoint(folder, engine)  # the step after the save did not reach the checkpoint
        assert all(torch.equal(p, q) for p, q in zip(engine.params, saved))
    with log.case("background-part-error"):  # rank 1 cannot write its part: every rank fails, latest stays
        import tpzoo.checkpoint.save as save

        part = save.write_part

        def full(folder, rank, error=None, **kwargs):
            if rank == 1 and error is None:
                raise OSError(errno.ENOSPC, "No space left on device", str(folder / "manifest.1.part"))
            return part(folder, rank, error, **kwargs)

        save.write_part = full
        try:
            save_checkpoint(root / "background", 4, engine, meta={}, background=True)
            try:
                wait_for_save()
            except save.CheckpointWriteError as e:
                error = str(e)
            else:
                raise AssertionError("the save succeeded")
        finally:
            save.write_part = part
        assert error.startswith(f"cannot write checkpoint {root}/background/iter_0000004: [Errno 28] No space left "
                                f"on device ({root}/background/iter_0000004.partial/manifest.1.part); "
                                f"{root}/background/latest still names iter_0000003") and "\n" not in error, error
        assert resolve_checkpoint(root / "background").name == "iter_0000003"
    for cases, bare in ((DAMAGES, False), (BARE, True)):
        for name, (damage, says) in cases.items():
            with log.case(name):
                folder = damaged_copy(root, name, damage, bare)
                error = load_error(lambda: load_checkpoint(folder, engine))
                assert f"{folder}{says}" in error and "\n" not in error, error
                assert error == load_error(lambda: load_model(folder, mesh)), "load_model says otherwise"
                gathered = [None, None]
                dist.all_gather_object(gathered, error)
                assert gathered[0] == gathered[1], gathered
    with log.case("missing-manifest-loads"):
        folder = damaged_copy(root, "no-manifest", lambda f: None, bare=True)
        warned.lines.clear()
        assert load_checkpoint(folder, engine)["iteration"] == 2
        assert any(f"{folder} has no {MANIFEST_FILE}" in line for line in warned.lines) == (dist.get_rank() == 0)
    with log.case("old-checkpoint-loads"):
        warned.lines.clear()
        load_model(FIXTURE, ParallelPlan(mesh, kernels="torch"))
        assert any(f"has no {MANIFEST_FILE}" in line for line in warned.lines) == (dist.get_rank() == 0)
    with log.case("fallback"):  # latest (iter 2) damaged: iter 1 loads, with a warning naming what was skipped
        on_rank0(lambda: (shutil.copytree(run, root / "fallback"), _flip(root / "fallback" / "iter_0000002" / SHARD)))
        warned.lines.clear()
        assert resolve_checkpoint(root / "fallback", collective=True).name == "iter_0000001"
        assert load_checkpoint(root / "fallback", engine)["iteration"] == 1
        if dist.get_rank() == 0:
            assert warned.lines[0] == (f"{root}/fallback: loading iter_0000001 instead of iter_0000002 (skipped "
                                       f"iter_0000002: {root}/fallback/iter_0000002/{SHARD}: sha256 differs from the "
                                       f"manifest's (the file is corrupt))"), warned.lines
    with log.case("none-intact"):
        on_rank0(lambda: _cut(root / "fallback" / "iter_0000001" / "meta.json"))
        error = load_error(lambda: load_checkpoint(root / "fallback", engine))
        assert error.startswith(f"{root}/fallback holds no intact checkpoint (iter_0000002: ") and "iter_0000001: " \
            in error and "\n" not in error, error
    with log.case("explicit-folder-no-fallback"):
        error = load_error(lambda: load_checkpoint(root / "fallback" / "iter_0000002", engine))
        assert error.startswith(f"checkpoint {root}/fallback/iter_0000002 is damaged: "), error
    with log.case("latest-not-utf8"):
        on_rank0(lambda: (root / "fallback" / "latest").write_bytes(b"iter_\xff\xfe\n"))
        error = load_error(lambda: load_checkpoint(root / "fallback", engine))
        assert error.startswith(f"{root}/fallback/latest is not UTF-8 text (") and "\n" not in error, error
    save_errors(log, root, engine)
    logging.getLogger("tpzoo.checkpoint").removeHandler(warned)
    return log


def save_errors(log: CaseLog, root: Path, engine: Engine) -> None:
    """A save that cannot write: one line naming the folder and the error on every rank; latest unchanged."""
    import tpzoo.checkpoint.save as save

    run = root / "run"

    def expect(case: str, says: str) -> None:
        try:
            save_checkpoint(run, 3, engine, meta={})
        except save.CheckpointWriteError as e:
            error = str(e)
        else:
            raise AssertionError("the save succeeded")
        assert error.startswith(f"cannot write checkpoint {run}/iter_0000003: {says}") and "\n" not in error, error
        assert f"{run}/latest still names iter_0000002" in error, error
        assert (run / "latest").read_text().strip() == "iter_0000002"
        assert load_checkpoint(run, engine)["iteration"] == 2

    with log.case("enospc"):  # rank 1 runs out of space opening its shard
        opened = io.open

        def full(file, mode="r", *args, **kwargs):
            if dist.get_rank() == 1 and "iter_0000003" in str(file) and set(mode) & set("wax+"):
                raise OSError(errno.ENOSPC, "No space left on device")
            return opened(file, mode, *args, **kwargs)

        io.open = builtins.open = full
        try:
            expect("enospc", "[Errno 28] No space left on device")
        finally:
            io.open = builtins.open = opened
    with log.case("eacces"):  # rank 0 may not create the folder
        prepare = save._prepare

        def denied(final, partial):
            raise PermissionError(errno.EACCES, "Permission denied", str(partial))

        save._prepare = denied
        try:
            expect("eacces", f"[Errno 13] Permission denied ({run}/iter_0000003.partial)")
        finally:
            save._prepare = prepare
    with log.case("save-is-a-file"):
        on_rank0(lambda: (root / "file").write_text("x"))
        try:
            save_checkpoint(root / "file", 1, engine, meta={})
        except save.CheckpointWriteError as e:
            assert str(e).startswith(f"cannot write checkpoint {root}/file/iter_0000001: [Errno 20] not a folder "
                                     f"({root}/file); no checkpoint was written"), str(e)
        else:
            raise AssertionError("saved into a file")
    with log.case("read-only"):  # root writes into a folder of mode 555: make it immutable instead
        root_user = os.geteuid() == 0
        lock, unlock = (["chattr", "+i"], ["chattr", "-i"]) if root_user else (["chmod", "555"], ["chmod", "755"])
        on_rank0(lambda: subprocess.run([*lock, str(run)], check=True))
        try:
            expect("read-only", "[Errno ")
        finally:
            on_rank0(lambda: subprocess.run([*unlock, str(run)], check=True))


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> list[CaseLog]:
    return spawn(checks, 2, str(tmp_path_factory.mktemp("integrity")), timeout=300)


@pytest.mark.parametrize("name", NAMES)
def test_integrity(logs, name):
    assert_case(logs, name)
