"""docs/parallelism.md's context-parallel commands, end to end: pretrain.py on packed documents
(--reset-position-ids, --reset-attention-mask, --eod-mask-loss) with each sequence split over 4 ranks
(--context-parallel-size 4, ring attention), and the same run in one process; and the page's misuse of the mesh.
Float32 without dropout: both log the same losses within 1e-5. In the background from the session's start."""

from __future__ import annotations

import background
import pytest
from doc_helpers import ROOT, commands, run_as_needed
from pretrain_helpers import metrics, rel

pytestmark = pytest.mark.tier("journey")

SECTION = "--cp 4"


def shown() -> list[str]:
    lines = [c for c in commands("parallelism.md") if "--reset-attention-mask" in c]
    assert len(lines) == 2 and SECTION in lines[0] and "--cp" not in lines[1], lines
    return lines


@background.fixture
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("context-parallel")
    (folder / "pretrain.py").symlink_to(ROOT / "pretrain.py")  # the commands as the page shows them
    a2a = shown()[0].replace("--cp 4", "--cp 4 --cp-comm-type a2a").replace("--save cp4", "--save cp4-a2a")
    done = run_as_needed([*shown(), a2a], folder, timeout=600)
    return {"folder": folder, "stdout": [d.stdout for d in done]}


@pytest.mark.parametrize("run", ["cp4", "cp4-a2a"])
def test_context_parallel_run_logs_the_one_process_losses(runs, run):
    split, whole = metrics(runs["folder"] / run), metrics(runs["folder"] / "cp1")
    assert split.keys() == whole.keys() and len(whole) >= 10, (split.keys(), whole.keys())
    for it, record in whole.items():
        for key in ("loss", "grad_norm", "val_loss"):
            if key in record:
                assert rel(split[it][key], record[key]) < 1e-5, (run, it, key, split[it][key], record[key])
    assert "x cp 4 (p2p)" in runs["stdout"][0] and "x cp 4 (a2a)" in runs["stdout"][2], runs["stdout"][0][:400]
