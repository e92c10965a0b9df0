"""A crafted checkpoint runs no code: its pickles are refused, with one line naming the file, by every
command that opens a checkpoint (pretrain.py --load, finetune.py --load, python -m tpzoo.generate,
python -m tpzoo.convert to-hf), and by the library without a process group."""

from __future__ import annotations

import io
import json
import os
import pickle
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties

from doc_helpers import ROOT, run_as_needed
from pretrain_helpers import TINY, pretrain
from tpzoo.checkpoint.manifest import MANIFEST_FILE, write_manifest
from tpzoo.checkpoint.reader import UnsafeCheckpointError, read_dcp_metadata

pytestmark = pytest.mark.tier("journey")





class Payload:
    """Unpickling this runs ``touch MARKER``: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The iteration folder of a one-step tiny GPT run."""
    root = tmp_path_factory.mktemp("pickles")
    pretrain(TINY + "--train-iters 1 --eval-interval 0 --save run".split(), root)
    return root / "run" / (root / "run" / "latest").read_text().strip()


def crafted(trained: Path, name: str, craft) -> Path:
    """A copy of ``trained`` with ``craft(folder)`` applied and its manifest written anew to match (an
    attacker who can rewrite the files can rewrite the manifest: it guards against damage, not malice)."""
    folder = trained.parent.parent / name / trained.name
    shutil.copytree(trained, folder)
    (folder.parent / "latest").write_text(trained.name + "\n")
    craft(folder)
    write_manifest(folder, {}, tuple(sorted(p.name for p in folder.iterdir() if p.name != MANIFEST_FILE)))
    return folder


def write_index(folder: Path, metadata) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def index_payload(marker: Path):
    def craft(folder: Path) -> None:
        (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return craft


def nested_payload(marker: Path):
    """A genuine index with the payload hidden in one of its own fields."""
    def craft(folder: Path) -> None:
        metadata = read_dcp_metadata(folder)
        metadata.storage_meta.modules = [Payload(marker)]
        write_index(folder, metadata)
    return craft


def entry_of(kind):
    """A genuine index whose first entry is ``kind()`` instead of a tensor's (bytes: DCP would read it with
    torch.load(weights_only=False))."""
    def craft(folder: Path) -> None:
        metadata = read_dcp_metadata(folder)
        metadata.state_dict_metadata[next(iter(metadata.state_dict_metadata))] = kind()
        write_index(folder, metadata)
    return craft


def shard_payload(marker: Path):
    """An index pointing one tensor at a torch.save blob whose pickle carries the payload."""
    def craft(folder: Path) -> None:
        blob = io.BytesIO()
        torch.save(Payload(marker), blob)
        (folder / "__evil.distcp").write_bytes(blob.getvalue())
        metadata = read_dcp_metadata(folder)
        index = next(i for i in metadata.storage_data if i.fqn.startswith("model."))
        info = metadata.storage_data[index]
        info.relative_path, info.offset, info.length = "__evil.distcp", 0, len(blob.getvalue())
        write_index(folder, metadata)
    return craft


def test_index_with_a_payload_is_refused_without_running_it(trained, tmp_path):
    marker = tmp_path / "ran"
    for name, craft in (("index-payload", index_payload(marker)), ("nested-payload", nested_payload(marker))):
        folder = crafted(trained, name, craft)
        with pytest.raises(UnsafeCheckpointError, match=f"{folder / '.metadata'} asks to load posix.system"):
            read_dcp_metadata(folder)
    assert not marker.exists(), "the payload ran"


def test_index_with_a_non_tensor_entry_is_refused(trained):
    folder = crafted(trained, "bytes-entry", entry_of(BytesStorageMetadata))
    with pytest.raises(UnsafeCheckpointError, match="asks to load torch.distributed.checkpoint.metadata.BytesStorage"):
        read_dcp_metadata(folder)
    folder = crafted(trained, "properties-entry", entry_of(TensorProperties))
    with pytest.raises(UnsafeCheckpointError, match="lists 1 non-tensor entries"):
        read_dcp_metadata(folder)


def reshaped(change):
    """A genuine index with ``change(metadata)`` applied: classes the unpickler builds, where no index has them."""
    def craft(folder: Path) -> None:
        metadata = read_dcp_metadata(folder)
        change(metadata)
        write_index(folder, metadata)
    return craft


def _outside(metadata) -> None:
    next(iter(metadata.storage_data.values())).relative_path = "../../etc/passwd"


SHAPES = {  # case -> (change to a genuine index, what the error says is wrong)
    "entries-list": (lambda m: setattr(m, "state_dict_metadata", list(m.state_dict_metadata.values())),
                     "its state_dict_metadata is a list, not a dict keyed by tensor names"),
    "path-outside": (_outside, " at '../../etc/passwd', not a file name inside the checkpoint folder"),
    "storage-meta-path": (lambda m: setattr(m, "storage_meta", Path("/etc")),
                          "its storage_meta is a PosixPath, not a StorageMeta"),
    "storage-data-list": (lambda m: setattr(m, "storage_data", list(m.storage_data.values())),
                          "its storage_data is a list, not a dict"),
    "planner-data-size": (lambda m: setattr(m, "planner_data", {"x": torch.Size([1])}),
                          "its planner_data holds more than plain containers"),
}


@pytest.mark.parametrize("case", SHAPES)
def test_index_of_the_wrong_shape_is_refused_in_one_line(trained, case):
    change, says = SHAPES[case]
    folder = crafted(trained, f"shape-{case}", reshaped(change))
    with pytest.raises(UnsafeCheckpointError) as refused:
        read_dcp_metadata(folder)
    error = str(refused.value)
    assert error.startswith(f"{folder / '.metadata'} is not a checkpoint index as tpzoo writes it: its "), error
    assert says in error and "\n" not in error, error


def test_truncated_or_garbled_index_names_the_file(trained):
    folder = crafted(trained, "truncated-index", lambda f: (f / ".metadata").write_bytes(
        (f / ".metadata").read_bytes()[:100]))
    with pytest.raises(ValueError, match=f"{folder / '.metadata'} is unreadable .*truncated or corrupt"):
        read_dcp_metadata(folder)
    (folder / ".metadata").write_bytes(b"\x80\x05garbage")
    with pytest.raises(ValueError, match="is unreadable"):
        read_dcp_metadata(folder)


def test_genuine_index_still_reads(trained):
    metadata = read_dcp_metadata(trained)
    assert any(k.startswith("model.") for k in metadata.state_dict_metadata)
    assert json.loads((trained / "meta.json").read_text())["iteration"] == 1


COMMANDS = {  # command -> argv after the interpreter, {ckpt} = the crafted iteration folder
    "pretrain": [str(ROOT / "pretrain.py"), "--load", "{ckpt}", "--train-iters", "2"],
    "finetune": [str(ROOT / "finetune.py"), "--load", "{ckpt}", "--train-data", "{data}", "--valid-data", "{data}",
                 "--epochs", "1"],
    "generate": ["-m", "tpzoo.generate", "--load", "{ckpt}", "--prompt", "the"],
    "convert": ["-m", "tpzoo.convert", "to-hf", "{ckpt}", "hf-out"],
}


@pytest.fixture(scope="module")
def refusals(trained):
    """Every command on a checkpoint whose index carries a payload, and generate on one whose shard does:
    (marker files, results by case)."""
    root = trained.parent.parent
    data = root / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"the cat sat on the mat {i}"}) + "\n" for i in range(8)))
    markers, cases = {}, {}
    for name in COMMANDS:
        markers[name] = root / f"ran-{name}"
        cases[name] = crafted(trained, f"cli-{name}", index_payload(markers[name]))
    markers["generate-shard"] = root / "ran-generate-shard"
    cases["generate-shard"] = crafted(trained, "cli-shard", shard_payload(markers["generate-shard"]))
    commands = [shlex.join([sys.executable, *[a.format(ckpt=cases[name], data=data)
                                              for a in COMMANDS[name.split("-")[0]]]]) for name in cases]
    return markers, dict(zip(cases, run_as_needed(commands, root, check=False)))


@pytest.mark.parametrize("case", [*COMMANDS, "generate-shard"])
def test_commands_refuse_a_crafted_checkpoint_in_one_line(refusals, case):
    markers, results = refusals
    done = results[case]
    assert not markers[case].exists(), f"the payload ran under {case}"
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert ("asks to load posix.system" if case != "generate-shard" else "__evil.distcp is unreadable") in lines[0]
    assert "weights_only" not in lines[0] and "succeed" not in lines[0], lines[0]  # never advice to turn safety off
