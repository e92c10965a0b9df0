"""docs/new-model.md runs as shown: its Python blocks saved under the names they start with (neox.py,
neox_family.py, ...), its commands in that folder.

- plain.py trains the model file on one device; hf_neox.py converts Hugging Face's GPT-NeoX to the family
  and back (logits within 1e-5, the round trip bit for bit);
- train_neox.py under torchrun trains it at tp 2 x pp 2 x dp 2 with sequence parallelism, the loss falls;
- pretrain.py trains the family from outside the tree (--model neox_family:NEOX), saves at 3 and 6, the
  second launch resumes iteration 3 at tp 2 with sequence parallelism and logs iterations 4..6 with the
  first run's losses, and generate samples from that;
- without --model, loading the checkpoint is refused in one line naming the family's module (generate and
  pretrain.py --load), and nothing is imported from what the checkpoint says.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import background
import pytest
from doc_helpers import ROOT, blocks, commands, run, run_as_needed
from pretrain_helpers import metrics, rel

pytestmark = pytest.mark.tier("journey")



DOC = "new-model.md"
FILES = ("neox.py", "plain.py", "train_neox.py", "neox_family.py", "hf_neox.py")


@background.fixture
def page(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """The page's files and commands, run in a folder of their own: (the folder, each command's result)."""
    root = tmp_path_factory.mktemp("new-model")
    for code in blocks(DOC, "python"):
        name = code.splitlines()[0].removeprefix("# ")
        (root / name).write_text(code)
    (root / "pretrain.py").symlink_to(ROOT / "pretrain.py")
    return root, run_as_needed(commands(DOC), root, slots=1, timeout=900)


@pytest.mark.tier("unit")
def test_page_has_its_files_and_commands():
    assert [b.splitlines()[0] for b in blocks(DOC, "python")] == [f"# {name}" for name in FILES]
    shown = commands(DOC)
    assert shown[0] == "torchrun --nproc-per-node 8 train_neox.py"
    assert any("--model neox_family:NEOX" in c and "--load" in c and "--tp 2" in c for c in shown)


def test_plain_model_and_hugging_face_round_trip(page):
    root, _ = page
    plain, hf = (run([sys.executable, script], root) for script in ("plain.py", "hf_neox.py"))
    assert plain.returncode == 0 and hf.returncode == 0, plain.stderr[-3000:] + hf.stderr[-3000:]
    assert re.search(r"loss \d+\.\d+, [\d,]+ parameters", plain.stdout), plain.stdout
    found = re.search(r"largest logit difference vs Hugging Face: (\S+)", hf.stdout)
    assert found and float(found.group(1)) < 1e-5, hf.stdout


def test_engine_trains_the_model_file_at_tp2_pp2_dp2(page):
    _, (engine, *_) = page
    found = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) over 30 steps at tp 2 x pp 2 x dp 2", engine.stdout)
    assert found, engine.stdout
    first, last = map(float, found.groups())
    assert last < first - 0.5, f"the loss did not fall: {first} -> {last}"


def test_family_outside_the_tree_trains_resumes_on_another_mesh_and_generates(page):
    root, (_, first, resumed, generated) = page
    saved, again = metrics(root / "runs" / "neox"), metrics(root / "runs" / "neox-tp2")
    assert sorted(saved) == list(range(1, 7)) and sorted(again) == [4, 5, 6], (sorted(saved), sorted(again))
    worst = max(rel(again[i]["loss"], saved[i]["loss"]) for i in again)
    print(f"resumed at tp 2 with sequence parallelism: largest loss difference {worst:.1e}")
    assert worst <= 1e-5
    meta = (root / "runs" / "neox" / "iter_0000003" / "meta.json").read_text()
    assert '"source": "neox_family:NEOX"' in meta
    assert "the cat" in generated.stdout and len(generated.stdout.split()) > 2, generated.stdout


def test_checkpoint_of_an_unloaded_family_is_refused_in_one_line(page):
    root, _ = page
    for command, script in ((f"{sys.executable} -m tpzoo.generate --load runs/neox --prompt cat", "generate"),
                            (f"{sys.executable} pretrain.py --load runs/neox --save runs/again", "pretrain.py")):
        done = run(shlex.split(command), root)  # no --model: tpzoo must not import the module the checkpoint names
        assert done.returncode == 2, (command, done.stdout, done.stderr[-2000:])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "neox_family:NEOX" in lines[0] and "--model neox_family:NEOX" in lines[0], lines
        assert "Traceback" not in done.stderr, script
    assert not (root / "runs" / "again").exists()
