"""LoRA through the engine (tpzoo.parallel.lora): on 4 gloo ranks (one spawn, each check its own case), 10
steps of the grouped-query causal LM with adapters on every linear layer of its transformer layers, on meshes
(tp, pp, dp) = (2, 1, 2), (1, 2, 2) and (1, 1, 4), each with ZeRO-1 and with FSDP (and the q/k/v-biased LM
once, at tp 2),
equal the single-process run within 1e-5: losses, gradient norms and the adapters' final weights; the
frozen weights are bit-identical after training; optimizer state exists for the adapters alone (bytes
counted against AdamW's for their elements).
"""

from __future__ import annotations

import functools

import pytest
import torch
from cases import CaseLog, assert_case
from families import CASES, GQA_LM, QKV_BIAS_LM
from test_engine import CLIP, EPS, LR, STEPS, WD, compare, config_of, global_batch, reference

import background
from tpzoo.engine.config import EngineConfig
from tpzoo.engine.data_parallel import optimizer_state_bytes
from tpzoo.engine.train_step import Engine
from tpzoo.lora_options import LoRAConfig
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.parallel.fsdp import local
from tpzoo.parallel.lora import add_adapters
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")

G = 16
LORA = LoRAConfig(rank=4, alpha=8.0, targets="query_key_value,dense,dense_h_to_4h,dense_4h_to_h")
MESHES = [(1, 1, 4), (1, 2, 2), (2, 1, 2)]


def run_name(name: str, tp: int, pp: int, dp: int, sharding: str) -> str:
    return f"lora-{name}-tp{tp}-pp{pp}-dp{dp}-{sharding}"


# the grouped-query LM with ZeRO-1 and with FSDP on every mesh; the q/k/v-biased one (its adapters beside a fused
# bias) once
RUNS = [(GQA_LM.name, mesh, sharding) for mesh in MESHES for sharding in ("zero1", "fsdp")] + [
    (QKV_BIAS_LM.name, MESHES[-1], "zero1")]
CASE_NAMES = [run_name(n, *mesh, s) for n, mesh, s in RUNS]


def adapted(name: str, tp: int, plan, **stage):
    model = CASES[name].build(config_of(name, tp), plan, **stage)
    add_adapters(model, LORA, seed=3)
    return model


def references() -> dict:
    """test_engine's single-process reference of each run's model with its adapters (AdamW on them alone)."""
    return {(name, mesh[0]): reference(name, mesh[0], functools.partial(adapted, name, mesh[0]))
            for name, mesh, _ in RUNS}


def lora_checks(refs: dict) -> CaseLog:
    import torch.distributed as dist

    log = CaseLog()
    for name, (tp, pp, dp), sharding in RUNS:
        mesh = init_mesh(tp=tp, pp=pp, dp=dp)  # groups of its own: a pipeline's p2p after another engine's
        with log.case(run_name(name, tp, pp, dp, sharding)):
            config = config_of(name, tp)
            plan = ParallelPlan(mesh, kernels="torch", fsdp=sharding == "fsdp")
            engine = Engine(functools.partial(adapted, name, tp), config,
                            EngineConfig(micro_batch_size=G // (dp * pp), global_batch_size=G,
                                         schedule="1f1b", lr=LR, weight_decay=WD, adam_eps=EPS, clip_grad=CLIP,
                                         use_distributed_optimizer=sharding == "zero1",
                                         zero_stage=1 if sharding == "zero1" else None), plan)
            frozen = {n: p.detach().clone() for c in engine.chunks for n, p in c.model.named_parameters()
                      if not p.requires_grad}
            assert frozen and all("lora_" not in n for n in frozen), sorted(frozen)[:4]
            results = [engine.train_step(global_batch(name, step)) for step in range(STEPS)]
            held = torch.tensor([optimizer_state_bytes(engine.optimizer),
                                 sum(2 * 4 * local(p).numel() + 4 for p in engine.main.owned)], dtype=torch.float64)
            dist.all_reduce(held)  # the collectives (this sum, compare's gathers) before any check
            compare(engine, results, refs[name, tp], log)
            after = {n: p.detach() for c in engine.chunks for n, p in c.model.named_parameters()
                     if not p.requires_grad}
            # by local shards: torch.equal of two DTensors is a collective, and the stages hold different weights
            changed = [n for n in frozen if not torch.equal(local(frozen[n]), local(after[n]))]
            assert not changed, f"frozen weights changed: {changed[:4]}"
            assert held[0] == held[1] > 0, f"optimizer state {held[0]:.0f} B, AdamW of the adapters' " \
                                           f"{held[1]:.0f} B"
            assert all(p.requires_grad == ("lora_" in n) for c in engine.chunks
                       for n, p in c.model.named_parameters())
    return log


@pytest.fixture(scope="module")
def logs() -> list[CaseLog]:
    refs = background.spawn(references, 1)[0]
    return spawn(lora_checks, 4, refs, timeout=600)


def test_every_lora_check_has_a_case(logs):
    assert logs[0].ran == CASE_NAMES


@pytest.mark.parametrize("name", CASE_NAMES)
def test_lora_equals_single_process(logs, name):
    assert_case(logs, name)
