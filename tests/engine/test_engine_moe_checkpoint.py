"""A mixture of experts' checkpoint reshards over expert parallelism (issue 28): Mixtral's tiny case (4 experts, its
router's losses in the training loss) trained on 8 gloo ranks at (tp, pp, dp, ep) = (1, 2, 4, 2) with ZeRO-2 (each
rank holds 2 of the 4 experts, their gradients and optimizer state owned over the expert-data-parallel group), saved
after step 2, resumes at (2, 1, 4, 4) without ZeRO (one expert a rank, each split over tp) and in one process: the
next 2 losses equal the uninterrupted run's, the expert weights and their AdamW moments are stored whole (all 4
experts, as the model at ep 1 holds them). Under FSDP too: saved at (2, 1, 4, 2) (each rank one expert of its ep
rank's 2, the experts sharded over their 2 edp ranks), resumed at (1, 1, 8, 4) under FSDP (one expert an ep rank,
over 2 edp ranks: one holds it, one holds no rows) and in one process. Each check is its own case."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import CaseLog, assert_case
from families import MOE_AUX_LM
from test_engine import global_batch, train
from torch.distributed.checkpoint import FileSystemReader

from tpzoo.checkpoint import load_checkpoint, save_checkpoint
from tpzoo.parallel import init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")

NAME, SAVE_AT, STEPS, TOL = MOE_AUX_LM.name, 2, 4, 1e-6
SAVED, RESUMED = (1, 2, 4, 2), (2, 1, 4, 4)  # (tp, pp, dp, ep)
FSDP_SAVED, FSDP_RESUMED = (2, 1, 4, 2), (1, 1, 8, 4)
EXPERT_KEY = "layers.0.mlp.experts.dense_h_to_4h"
CASES = ["moe-save-tp1-pp2-dp4-ep2-zero2", "moe-experts-stored-whole", "moe-resume-tp2-pp1-dp4-ep4",
         "moe-resume-one-process", "moe-save-tp2-pp1-dp4-ep2-fsdp", "moe-fsdp-resume-tp1-pp1-dp8-ep4-fsdp",
         "moe-fsdp-resume-one-process"]
ONE_PROCESS = (CASES[3], CASES[6])


def mesh_of(shape: tuple[int, int, int, int]):
    tp, pp, dp, ep = shape
    return init_mesh(tp=tp, pp=pp, dp=dp, ep=ep)


def resume(folder: str, mesh, losses: list[float], log: CaseLog, **options) -> None:
    engine, _ = train(NAME, mesh, "1f1b", steps=0, **options)
    assert load_checkpoint(folder, engine)["iteration"] == SAVE_AT
    got = [engine.train_step(global_batch(NAME, step)).loss for step in range(SAVE_AT, STEPS)]
    log.close(torch.tensor(got), torch.tensor(losses), "losses after resuming", "loss", TOL)


def eight_ranks(folder: str) -> tuple[CaseLog, list[list[float]]]:
    log, losses = CaseLog(), []
    with log.case(CASES[0]):
        engine, _ = train(NAME, mesh_of(SAVED), "1f1b", steps=SAVE_AT, use_distributed_optimizer=True)
        save_checkpoint(folder, SAVE_AT, engine, meta={})
        losses = [engine.train_step(global_batch(NAME, step)).loss for step in range(SAVE_AT, STEPS)]
    with log.case(CASES[1]):
        dist.barrier()
        stored = FileSystemReader(f"{folder}/iter_{SAVE_AT:07d}").read_metadata().state_dict_metadata
        for prefix in ("model.", "optim."):
            key = prefix + EXPERT_KEY + (".exp_avg" if prefix == "optim." else "")
            assert tuple(stored[key].size)[0] == 4, f"{key}: stored {tuple(stored[key].size)}, not all 4 experts"
    with log.case(CASES[2]):
        resume(folder, mesh_of(RESUMED), losses, log)
    with log.case(CASES[4]):
        engine, _ = train(NAME, mesh_of(FSDP_SAVED), "1f1b", steps=SAVE_AT, fsdp=True)
        save_checkpoint(f"{folder}-fsdp", SAVE_AT, engine, meta={})
        fsdp_losses = [engine.train_step(global_batch(NAME, step)).loss for step in range(SAVE_AT, STEPS)]
    with log.case(CASES[5]):
        resume(f"{folder}-fsdp", mesh_of(FSDP_RESUMED), fsdp_losses, log, fsdp=True)
    return log, [losses, fsdp_losses]


def one_process(folder: str, losses: list[list[float]]) -> CaseLog:
    log = CaseLog()
    for name, saved, uninterrupted in zip(ONE_PROCESS, (folder, f"{folder}-fsdp"), losses):
        with log.case(name):
            resume(saved, init_mesh(), uninterrupted, log)
    return log


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, list[CaseLog]]:
    folder = str(tmp_path_factory.mktemp("moe-checkpoint"))
    out = spawn(eight_ranks, 8, folder, timeout=600)
    return {"eight": [log for log, _ in out], "one": spawn(one_process, 1, folder, out[0][1], timeout=300)}


@pytest.mark.parametrize("name", CASES)
def test_moe_checkpoint_reshards(logs, name):
    assert_case(logs["one" if name in ONE_PROCESS else "eight"], name)
