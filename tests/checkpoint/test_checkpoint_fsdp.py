"""FSDP checkpoints are the same files as plain ones: saved under FSDP, resumed without it on another
mesh, and the other way round.

One 4-rank spawn trains GPT and BERT (fp32, dropout off) under FSDP at (tp, pp, dp) = (1, 1, 4) for 5
steps, saving after step 3 (``full_state_dict`` gathers the saved weights, ``load_full_state_dict``
writes them back into the dp shards). Resumed at (2, 2, 1) without FSDP the full weights and optimizer state equal
the saved ones bit for bit and the next 2 losses the uninterrupted run's; that engine saves again
(a plain checkpoint), which an FSDP engine at (2, 1, 2) resumes alike and saves once more (tp-sharded
dp pieces); ``load_model`` rebuilds both FSDP checkpoints' weights. A 1-rank spawn resumes the FSDP
checkpoints at (1, 1, 1). GPT's vocabulary (500) and BERT's (101) are padded: those tensors go through
the gathered path; BERT's token types (2 rows) leave some dp ranks no rows at dp = 4.
"""

from __future__ import annotations

from functools import partial

import background
import pytest
import torch
from cases import CaseLog, assert_case
from families import CAUSAL_LM_UNTIED, MASKED_LM
from test_checkpoint import CLIP, EPS, G, LR, SAVE_AT, STEPS, WD, assert_same_state, batch, gathered_state, model_config
from torch.distributed.tensor import DTensor

from tpzoo.checkpoint import load_checkpoint, load_model, save_checkpoint
from tpzoo.engine import Engine, EngineConfig
from tpzoo.models import full_state_dict
from tpzoo.models.sharding import load_full_state_dict
from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed

pytestmark = pytest.mark.tier("distributed")



KINDS = {case.family: case for case in (CAUSAL_LM_UNTIED, MASKED_LM)}  # test_checkpoint's models, by family
TOL = 1e-5  # FSDP sums the gradients over dp in another order than the all-reduce
SAVED_AT = (1, 1, 4)  # (tp, pp, dp), under FSDP
PLAIN_AT, FSDP_AT = (2, 2, 1), (2, 1, 2)
TO_PLAIN, TO_FSDP = (f"{to}-tp{tp}-pp{pp}-dp{dp}" for to, (tp, pp, dp) in (("fsdp-to-plain", PLAIN_AT),
                                                                          ("plain-to-fsdp", FSDP_AT)))
NAMES = [f"{kind}-{case}" for kind in KINDS for case in ("fsdp-save", TO_PLAIN, TO_FSDP, "load-model")] + [
    f"{kind}-fsdp-to-single-rank" for kind in KINDS]


def make_engine(kind: str, shape: tuple[int, int, int], fsdp: bool) -> Engine:
    tp, pp, dp = shape
    mesh = init_mesh(tp=tp, pp=pp, dp=dp)
    manual_seed(7 if fsdp else 99, mesh)  # another seed: only the loaded weights give the same losses
    config = model_config(KINDS[kind])
    return Engine(partial(KINDS[kind].build, config), config,
                  EngineConfig(micro_batch_size=G // (dp * pp), global_batch_size=G, lr=LR, weight_decay=WD,
                               adam_eps=EPS, clip_grad=CLIP), ParallelPlan(mesh, kernels="torch", fsdp=fsdp))


def train(engine: Engine, kind: str, steps: range) -> list[float]:
    return [engine.train_step(batch(KINDS[kind], step)).loss for step in steps]


def check_losses(got: list[float], expected: list[float], tag: str, log: CaseLog) -> None:
    log.close(torch.tensor(got), torch.tensor(expected), f"{tag}: losses after resuming", tag, TOL)


def resume(folder: str, kind: str, shape: tuple[int, int, int], fsdp: bool, ref: dict, tag: str, log: CaseLog,
           save_to: str | None = None) -> None:
    """An engine at ``shape`` loads ``folder``: the saved state bitwise (saved again to ``save_to`` as
    loaded), then the uninterrupted run's losses."""
    engine = make_engine(kind, shape, fsdp)
    assert load_checkpoint(folder, engine)["iteration"] == SAVE_AT
    assert all(isinstance(p, DTensor) for p in engine.params) == fsdp, f"{tag}: FSDP {fsdp} parameters"
    assert_same_state(engine, ref["state"], tag)
    if save_to:
        save_checkpoint(save_to, SAVE_AT, engine, meta={})
    check_losses(train(engine, kind, range(SAVE_AT, STEPS)), ref["losses"], tag, log)


def check_load_model(folder: str, ref: dict, shape: tuple[int, int, int]) -> None:
    """``load_model`` at ``shape`` (without FSDP) holds the saved weights."""
    tp, pp, dp = shape
    model = load_model(folder, ParallelPlan(init_mesh(tp=tp, pp=pp, dp=dp), kernels="torch"))
    for name, value in full_state_dict(model).items():
        assert torch.equal(value, torch.from_numpy(ref["state"][0][name])), f"load_model {folder}: {name}"


def four_ranks(root: str) -> tuple[CaseLog, dict]:
    log, refs = CaseLog(), {}
    for kind in KINDS:
        with log.case(f"{kind}-fsdp-save"):
            engine = make_engine(kind, SAVED_AT, True)
            train(engine, kind, range(SAVE_AT))
            save_checkpoint(f"{root}/{kind}-fsdp", SAVE_AT, engine, meta={})
            state = gathered_state(engine)
            for chunk in engine.chunks:  # full_state_dict gathers the dp pieces (and the tp shards)
                assert all(isinstance(v, DTensor) for v in chunk.model.state_dict().values())
                full = full_state_dict(chunk.model)
                for name, value in full.items():
                    assert torch.equal(value, torch.from_numpy(state[0][name])), f"full_state_dict: {name}"
                with torch.no_grad():  # load_full_state_dict writes each rank's dp rows back
                    for p in chunk.model.parameters():
                        p.zero_()
                load_full_state_dict(chunk.model, full)
                assert all(torch.equal(v, full[k]) for k, v in full_state_dict(chunk.model).items())
            refs[kind] = dict(state=state, losses=train(engine, kind, range(SAVE_AT, STEPS)))
        with log.case(f"{kind}-{TO_PLAIN}"):
            resume(f"{root}/{kind}-fsdp", kind, PLAIN_AT, False, refs[kind], f"{kind} FSDP -> plain", log,
                   save_to=f"{root}/{kind}-plain")
        with log.case(f"{kind}-{TO_FSDP}"):
            resume(f"{root}/{kind}-plain", kind, FSDP_AT, True, refs[kind], f"{kind} plain -> FSDP", log,
                   save_to=f"{root}/{kind}-fsdp-tp2")
        with log.case(f"{kind}-load-model"):
            check_load_model(f"{root}/{kind}-fsdp", refs[kind], (2, 1, 2))
            check_load_model(f"{root}/{kind}-fsdp-tp2", refs[kind], (1, 1, 4))
    return log, refs


def one_rank(root: str, refs: dict) -> CaseLog:
    log = CaseLog()
    for kind in KINDS:
        with log.case(f"{kind}-fsdp-to-single-rank"):
            resume(f"{root}/{kind}-fsdp", kind, (1, 1, 1), False, refs[kind], f"{kind} FSDP -> 1 rank", log)
    return log


@background.fixture
def logs(tmp_path_factory) -> dict[str, list[CaseLog]]:
    root = str(tmp_path_factory.mktemp("fsdp-checkpoints"))
    results = background.spawn(four_ranks, 4, root, timeout=600)
    logs = {"four": [log for log, _ in results],
            "one": background.spawn(one_rank, 1, root, results[0][1], timeout=300)}
    worst = {k: v for log in logs["four"] + logs["one"] for k, v in log.max.items()}
    print("largest relative loss differences:", {k: f"{v:.1e}" for k, v in worst.items()})
    return logs


@pytest.mark.parametrize("name", NAMES)
def test_fsdp_checkpoint(logs, name):
    assert_case(logs["one" if name.endswith("single-rank") else "four"], name)
