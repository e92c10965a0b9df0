"""The 3D engine: on every mesh and schedule, 5 steps of every model family equal the single-rank run
(a 4-rank and an 8-rank spawn; each run is its own test case, named by family, mesh, schedule and options).

The meshes (tp, pp, dp): each pair of axes on 4 ranks (``FOUR``), all three and each axis alone at its full
width of 8 on 8 ranks (``EIGHT``: tp 8 with one head a rank, pp 8 interleaved with empty chunks, dp 8 with ZeRO
pieces of size 0). A collective on gloo costs each of 8 ranks about 2.5 times what it costs each of 4 (2-core
CI, measured), so the meshes whose point is not the 8-wide extreme run on 4.

The references are plain single-process training (whole global batch, one backward, torch's
clip_grad_norm_, AdamW), computed once per case in a 1-rank spawn and handed to the ranks, which
loop over their meshes and run the engine on each; the (1, 1, 1) mesh runs the engine in a 1-rank
spawn. Cases: every family's pretraining model (``families.MAIN``: GPT, BERT with its binary head,
Llama, Qwen2, Qwen3, Mistral), a GPT on packed examples (``document_ids``) and, on four meshes, the
classifiers (``families.ENGINE_CLASSIFIERS``: BERT's, and a decoder's read at its last real token).
Coverage by default (``variants``): ``PER_MESH`` runs a mesh (``PIPELINED`` with a pipeline), the families, the schedules and the option
setting (ZeRO-2, recompute and sequence parallelism all on or all off) rotating, so that every family
runs on several meshes, with and without a pipeline, and every mesh and schedule meets both settings.
With ``TPZOO_ENGINE_MATRIX=full``: every combination.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from typing import Callable

import background
import pytest
import torch
import torch.distributed as dist
from cases import CaseLog, assert_case
from families import CASES, ENGINE_CLASSIFIERS, ENGINE_PRETRAINING, MAIN, batch

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.data_parallel import optimizer_state_bytes
from tpzoo.engine.train_step import Engine
from tpzoo.models import full_state_dict
from tpzoo.parallel import ParallelPlan, init_mesh

pytestmark = pytest.mark.tier("distributed")



G, S, VOCAB, STEPS, CLASSES = 16, 8, 101, 5, 3
TOL = 1e-5
# The final weights are compared per tensor: max |w - w_ref| / max |w_ref| <= TOL. AdamW's update
# lr m / (sqrt(v) + eps) normalises each gradient element, so where |g| is small it turns float32
# summation-order noise (engine and reference add the same numbers in different orders) into weight
# noise: with eps=1e-6, BERT tp=8 (all options) ended 1.3e-4 apart on head.lm_head.dense.weight,
# while the same run in float64 agrees to 1e-14 (no engine bug). eps=1e-4 makes elements with |g|
# below it SGD-like (update proportional to g: a wrong gradient still shows, noise is not blown
# up): that run's worst tensor drops to 1.5e-6. lr 3e-3 made the tiny Llama's training chaotic: two
# single-rank runs that only split the batch differently (summation order) drifted from 1e-7 to 2.8e-5
# apart in gradient norm by step 10; at 1e-3 they stay within 1e-7.
LR, WD, CLIP, EPS = 1e-3, 0.01, 0.5, 1e-4
# The mesh matrix's final weights: on an AMD EPYC (2026-12-07, torch 2.13.0) GPT at tp 8 with sequence parallelism
# (one token a rank) ends 1.37e-5 apart on layers.5.self_attention.dense.bias, whose step-0 gradient equals the
# reference's to 1.5e-7 once clipped alike (the tp ranks' sequence shards sum in another order; AdamW blows the
# difference up where |g| is small); 4.2e-6 without sequence parallelism. Losses and norms stay within TOL.
MESH_WEIGHT_TOL = 2e-5
BUCKET_MB = 0.05  # 50 KiB: 5 gradient buckets of the tiny models (~220 KiB), reduce-scattered under ZeRO-2 with
                  # pieces of size 0 at dp 8 (the default 25 MiB would make one)
TINY = dict(num_layers=6, hidden_size=32, num_attention_heads=8, ffn_hidden_size=64, vocab_size=VOCAB,
            max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0)
FOUR = [(1, 2, 2), (2, 2, 1), (2, 1, 2)]  # (tp, pp, dp): each pair of axes
EIGHT = [(2, 2, 2), (1, 1, 8), (8, 1, 1), (1, 8, 1)]  # all three, and each alone 8 wide
MESHES = FOUR + EIGHT
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble")
PRETRAINING = [name for name in MAIN if CASES[name].inputs != "classification"] + list(ENGINE_PRETRAINING)
# mesh: (classifier, schedule, every option on)
CLASSIFIER_RUNS = {(1, 2, 2): (ENGINE_CLASSIFIERS[0], "gpipe", True),
                   (2, 2, 1): (ENGINE_CLASSIFIERS[1], "interleaved-zero-bubble", True),
                   (2, 2, 2): (ENGINE_CLASSIFIERS[1], "1f1b", True), (1, 1, 1): (ENGINE_CLASSIFIERS[0], "1f1b", False)}
PER_MESH = 4  # runs a mesh without a pipeline besides the classifier's (``variants``)
PIPELINED = 3  # runs a mesh with one
FULL = os.environ.get("TPZOO_ENGINE_MATRIX") == "full"


def config_of(name: str, tp: int, seq: int = S):
    """The case's config at the test's sizes (sequences of ``seq`` tokens); kv heads (where the family has them):
    2, or tp when tp needs more of them to split (tp must divide the kv heads)."""
    case = CASES[name]
    changes = {"num_labels": CLASSES} if case.inputs == "classification" else {}
    if hasattr(case.config(), "num_query_groups"):
        changes["num_query_groups"] = max(2, tp)
    return case.config(**{**TINY, "max_position_embeddings": seq, **changes})


def ref_key(name: str, tp: int) -> str:
    """References differ where the config does (the kv heads of ``config_of``)."""
    return f"{name}/g{getattr(config_of(name, tp), 'num_query_groups', None)}"


def global_batch(name: str, step: int, seq: int = S) -> dict[str, torch.Tensor]:
    """Sequences [step G, (step+1) G) of ``seq`` tokens of a seeded synthetic corpus, with ignored labels and BERT
    padding; one per-sequence label is ignored (-100), so that its count is not G; none for a model without them."""
    g = torch.Generator().manual_seed(1000 + step)
    case = CASES[name]
    out = batch(case, torch.randint(0, VOCAB, (G, seq), generator=g), g, CLASSES)
    per_sequence = {"masked-lm": "next_sentence_label", "classification": "labels"}.get(case.inputs)
    if case.options.get("add_binary_head") is False:
        del out[per_sequence]
    elif per_sequence:
        out[per_sequence][step % G] = -100
    return out


def loss_parts(model, out, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A single-rank model's outputs given ``b``'s labels -> the mean loss of each label key."""
    keys = [k for k in model.label_keys if k in b]
    return {k: t.sum() / (b[k] != -100).sum() for t, k in zip(out if isinstance(out, tuple) else (out,), keys)}


def reference(name: str, tp: int, build: Callable | None = None, seq: int = S, steps: int = STEPS
              ) -> tuple[list[float], dict, list[float], list[dict[str, float]]]:
    """Single rank, no engine: the whole global batch in one forward, the mean loss of each label key
    (MLM tokens; BERT's binary head: sequences) added up, clip, AdamW on the parameters that train; also each
    step's parts. ``build(plan)``: the model (default: the case's at the test's sizes)."""
    plan = ParallelPlan(init_mesh(), kernels="torch")
    model = build(plan) if build is not None else CASES[name].build(config_of(name, tp, seq), plan)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, weight_decay=WD, eps=EPS)
    losses, norms, parts = [], [], []
    for step in range(steps):
        b = global_batch(name, step, seq)
        by_key = loss_parts(model, model(**b), b)
        loss = sum(by_key.values())
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trained, CLIP).item())
        opt.step()
        losses.append(loss.item())
        parts.append({k: v.item() for k, v in by_key.items()})
    state = {key: t.numpy() for key, t in full_state_dict(model).items()}  # numpy: crosses processes
    return losses, state, norms, parts


def references() -> dict:
    names = PRETRAINING + list(ENGINE_CLASSIFIERS)
    runs = {ref_key(name, tp): (name, tp) for name in names for tp in {1, *(mesh[0] for mesh in MESHES)}}
    return {key: reference(name, tp) for key, (name, tp) in runs.items()}


@functools.cache
def refs() -> dict:
    """The references, computed once for the 1-rank and the 8-rank runs (both in the background thread)."""
    return background.spawn(references, 1)[0]


def stage_layers(pp: int, schedule: str) -> tuple[int, ...] | None:
    """6 layers cannot fill the 16 chunks of pp=8 interleaved evenly: one layer on each of the ranks
    between the embedding's and the head's, then a round of empty chunks (which pass hidden states on)."""
    return (0, 1, 1, 1, 1, 1, 1, 0) + (0,) * 8 if pp == 8 and schedule.startswith("interleaved") else None


def train(name: str, mesh, schedule: str, steps: int = STEPS, recompute_activations: bool = False,
          sequence_parallel: bool = False, fsdp: bool = False, micro_batches: int | None = None,
          grouped_gemm: bool = False, cp_comm_type: str = "p2p", seq: int = S, **options) -> tuple[Engine, list]:
    """An engine on ``mesh`` with m = ``micro_batches`` per step, by default pp (the fewest that keep
    every schedule busy; the pipelines accumulate over them), on sequences of ``seq`` tokens; returns (engine, step
    results)."""
    plan = ParallelPlan(mesh, kernels="torch", recompute_activations=recompute_activations,
                        sequence_parallel=sequence_parallel, fsdp=fsdp, grouped_gemm=grouped_gemm,
                        cp_comm_type=cp_comm_type)
    config = config_of(name, mesh.tp_size, seq)
    engine = Engine(lambda plan, **stage: CASES[name].build(config, plan, **stage), config,
                    EngineConfig(micro_batch_size=G // (mesh.dp_size * (micro_batches or mesh.pp_size)),
                                 global_batch_size=G,
                                 schedule=schedule, stage_layers=stage_layers(mesh.pp_size, schedule), lr=LR,
                                 weight_decay=WD, adam_eps=EPS, clip_grad=CLIP, **{"bucket_mb": BUCKET_MB, **options}),
                    plan)
    return engine, [engine.train_step(global_batch(name, step, seq)) for step in range(steps)]


def compare(engine: Engine, results, ref, log: CaseLog, weight_tol: float = TOL) -> None:
    """Every step's loss, its part of each label key (BERT: MLM, sentence order) and gradient norm
    (before clipping) within TOL relative; every final weight tensor within ``weight_tol`` of that tensor's scale,
    max |w - w_ref| / max |w_ref| (see EPS). The weights are gathered (a collective) before any check."""
    ref_losses, ref_state, ref_norms, ref_parts = ref
    weights = [full_state_dict(chunk.model, engine.mesh) for chunk in engine.chunks]
    for step, (r, loss, norm, parts) in enumerate(zip(results, ref_losses, ref_norms, ref_parts)):
        assert r.losses.keys() == parts.keys(), f"step {step} loss parts {r.losses} vs {parts}"
        for what, got, expected in (("loss", r.loss, loss), ("grad norm", r.grad_norm, norm),
                                    *((f"{k} part", r.losses[k], v) for k, v in parts.items())):
            log.close(torch.tensor(got), torch.tensor(expected), f"step {step} {what}", what, TOL)
    for state in weights:
        for key, t in state.items():
            source = "embedding.word_embeddings.weight" if key == "head.word_embeddings.weight" else key
            log.close(t, torch.from_numpy(ref_state[source]), f"final {key}", "weight", weight_tol)


def options_of(on: bool, tp: int, fsdp: bool = False) -> dict:
    """The distributed optimizer (ZeRO-2; never with ``fsdp``, which shards more), recompute and sequence
    parallelism all ``on`` or off."""
    return dict(use_distributed_optimizer=on and not fsdp, recompute_activations=on, sequence_parallel=on and tp > 1,
                fsdp=fsdp)


def variants(index: int, tp: int, pp: int, dp: int, full: bool = FULL, fsdp: bool = False,
             schedules: tuple[str, ...] = SCHEDULES, classifier_runs: dict = CLASSIFIER_RUNS,
             per_mesh: int | None = PER_MESH, pipelined: int = PIPELINED, families: list[str] = PRETRAINING
             ) -> list[tuple[str, str, dict]]:
    """(case, schedule, options) for mesh number ``index``.

    Default: max(F, schedules) runs when pp > 1, else F runs of 1f1b; run j takes family j mod F, schedule
    (j + index) mod S and every option on when j // 2 + index is odd: every mesh meets every family and
    both settings, every schedule meets every family and both settings over the meshes, and every family
    both settings. ``per_mesh`` R: R runs a mesh instead (``pipelined`` of them when pp > 1), run j taking family
    (index R + j) mod F, schedule (index + j) mod S and every option on for j = 1, 2: the families spread over
    the meshes, each with and without a pipeline, every mesh and schedule meets both settings. ``full``: every combination of
    family, schedule, ZeRO-2 (when dp > 1), recompute and sequence parallelism (when tp > 1). Both
    add the classifier's run on the meshes of ``classifier_runs``. ``fsdp``: every run with FSDP (and
    no ZeRO-2), over ``schedules``.
    """
    if full:
        values = {True: (False, True), False: (False,)}
        out = [(name, schedule, dict(use_distributed_optimizer=zero, recompute_activations=recompute,
                                     sequence_parallel=sp, fsdp=fsdp))
               for name, schedule, zero, recompute, sp in itertools.product(
                   families, schedules if pp > 1 else ("1f1b",), values[dp > 1 and not fsdp], (False, True),
                   values[tp > 1])]
    elif per_mesh:
        out = [(families[(index * per_mesh + j) % len(families)],
                schedules[(index + j) % len(schedules)] if pp > 1 else "1f1b",
                options_of(j in (1, 2), tp, fsdp)) for j in range(pipelined if pp > 1 else per_mesh)]
    else:
        count = max(len(families), len(schedules)) if pp > 1 else len(families)
        out = [(families[j % len(families)], schedules[(j + index) % len(schedules)] if pp > 1 else "1f1b",
                options_of((j // 2 + index) % 2 == 1, tp, fsdp)) for j in range(count)]
    if (tp, pp, dp) in classifier_runs:
        name, schedule, on = classifier_runs[tp, pp, dp]
        out.append((name, schedule, options_of(on, tp, fsdp)))
    return out


def run_name(name: str, tp: int, pp: int, dp: int, schedule: str, options: dict, ep: int = 1) -> str:
    zero = "zero1" if options.get("zero_stage") == 1 else "zero2"
    on = [short for short, key in (("fsdp", "fsdp"), (zero, "use_distributed_optimizer"),
                                   ("recompute", "recompute_activations"), ("sp", "sequence_parallel")) if options[key]]
    m = f"-m{options['micro_batches']}" if options.get("micro_batches") else ""
    experts = f"-ep{ep}" if ep > 1 else ""
    return f"{name}-tp{tp}-pp{pp}-dp{dp}{experts}-{schedule}{m}-{'+'.join(on) or 'plain'}"


def run_names(meshes: list[tuple[int, int, int]]) -> list[str]:
    return [run_name(name, *mesh, schedule, options) for mesh in meshes
            for name, schedule, options in variants(index_of(mesh), *mesh)]


def adamw_bytes(engine: Engine) -> int:
    """What plain AdamW holds for this rank's parameters: two float32 moments and a step count each."""
    return sum(2 * p.numel() * 4 + 4 for p in engine.params)


def run_case(log: CaseLog, refs: dict, mesh, name: str, schedule: str, options: dict,
             check: Callable[[Engine, list], None] = lambda engine, results: None) -> None:
    """One run under its case name (``run_name``): train, ``compare`` with its reference, then
    ``check(engine, results)``; rank 0 prints the run's time."""
    tp, pp, dp = mesh.tp_size, mesh.pp_size, mesh.dp_size
    tag = run_name(name, tp, pp, dp, schedule, options, mesh.ep_size)
    t0 = time.perf_counter()
    with log.case(tag):
        engine, results = train(name, mesh, schedule, **options)
        compare(engine, results, refs[ref_key(name, tp)], log, MESH_WEIGHT_TOL)
        check(engine, results)
    if dist.get_rank() == 0:
        print(f"{tag}: {time.perf_counter() - t0:.1f}s", flush=True)


def check_meshes(refs: dict, meshes: list[tuple[int, int, int]]) -> tuple[CaseLog, dict]:
    """Every run of ``variants`` on each of ``meshes`` (tp, pp, dp; of ``MESHES``, whose position picks the runs,
    or (1, 1, 1)) against its single-rank reference,
    each under its own case name; also the ZeRO-2 state held per dp (largest per rank, plain AdamW's)."""
    log, zero = CaseLog(), {}

    def check_sharding(engine: Engine, options: dict) -> None:
        mesh, dp = engine.mesh, engine.mesh.dp_size
        if dp > 1 and "zero-bubble" not in engine.config.schedule:
            assert engine.reducer.overlapped == len(engine.reducer.buckets), "no overlap with backward"
        held = torch.tensor([optimizer_state_bytes(engine.optimizer), adamw_bytes(engine)])
        if options["use_distributed_optimizer"]:
            total = held.clone()
            dist.all_reduce(total[:1], group=mesh.dp_group)
            assert total[0] == held[1], f"ZeRO-2 state over dp {total[0]} B != AdamW's {held[1]} B"
            dist.all_reduce(held, op=dist.ReduceOp.MAX)
            zero[dp] = tuple(held.tolist())

    for tp, pp, dp in meshes:
        mesh = init_mesh(tp=tp, pp=pp, dp=dp)
        for name, schedule, options in variants(index_of((tp, pp, dp)), tp, pp, dp):
            run_case(log, refs, mesh, name, schedule, options,
                     lambda engine, _, options=options: check_sharding(engine, options))
    return log, zero


@background.fixture
def one_rank(tmp_path_factory) -> list[tuple[CaseLog, dict]]:
    # niced, it may wait long for a core on a busy machine (twice here beside two training runs: over 300 s)
    return background.spawn(check_meshes, 1, refs(), [(1, 1, 1)], timeout=1200)


def index_of(mesh: tuple[int, int, int]) -> int:
    """A mesh's position in ``MESHES`` (0 for (1, 1, 1)), which rotates its runs (``variants``)."""
    return MESHES.index(mesh) if mesh in MESHES else 0


def on_ranks(meshes: list[tuple[int, int, int]]) -> list[tuple[CaseLog, dict]]:
    """``check_meshes`` of ``meshes`` (all of one world size) in a spawn of that many ranks."""
    t0 = time.perf_counter()
    world = meshes[0][0] * meshes[0][1] * meshes[0][2]
    out = background.spawn(check_meshes, world, refs(), meshes, timeout=3600 if FULL else 1200)
    print(f"{world} ranks, {'full product' if FULL else 'rotating'}: {time.perf_counter() - t0:.0f}s; max relative "
          f"errors:", {k: f"{max(log.max.get(k, 0) for log, _ in out):.2e}" for k in out[0][0].max})
    return out


@background.fixture
def four_ranks(tmp_path_factory) -> list[tuple[CaseLog, dict]]:
    return on_ranks(FOUR)


@background.fixture
def eight_ranks(tmp_path_factory) -> list[tuple[CaseLog, dict]]:
    return on_ranks(EIGHT)


@pytest.mark.parametrize("name", run_names([(1, 1, 1)]))
def test_engine_on_one_rank_equals_single_rank(one_rank, name):
    assert_case([log for log, _ in one_rank], name)


@pytest.mark.timeout(3600 if FULL else 900)
@pytest.mark.parametrize("name", run_names(FOUR))
def test_engine_four_rank_meshes_equal_single_rank(four_ranks, name):
    assert_case([log for log, _ in four_ranks], name)


@pytest.mark.timeout(3600 if FULL else 900)
@pytest.mark.parametrize("name", run_names(EIGHT))
def test_engine_eight_rank_meshes_equal_single_rank(eight_ranks, name):
    assert_case([log for log, _ in eight_ranks], name)


def test_engine_distributed_optimizer_shards_the_optimizer_state(four_ranks, eight_ranks):
    zero = {**four_ranks[0][1], **eight_ranks[0][1]}
    print("ZeRO-2 optimizer state, largest per rank vs plain AdamW on that rank (bytes):", zero)
    assert set(zero) == {dp for _, _, dp in MESHES}
    for dp, (held, plain) in zero.items():
        assert held <= 1.5 * plain / dp + 1024, f"dp={dp}: a rank holds {held} B of {plain} B, not about 1/{dp}"


@pytest.mark.tier("unit")
def test_engine_variants_cover_every_family_and_option_on_every_mesh_and_schedule():
    runs = [(mesh, name, schedule, options) for i, mesh in enumerate(MESHES)
            for name, schedule, options in variants(i, *mesh, full=False) if name in PRETRAINING]
    for option in ("use_distributed_optimizer", "recompute_activations", "sequence_parallel"):
        for mesh in MESHES:
            values = {r[3][option] for r in runs if r[0] == mesh}
            possible = option != "sequence_parallel" or mesh[0] > 1
            assert values == ({False, True} if possible else {False}), (mesh, option)
        for schedule in SCHEDULES:
            assert {r[3][option] for r in runs if r[2] == schedule} == {False, True}, (schedule, option)
    for name in PRETRAINING:  # on several meshes, with and without a pipeline, both settings
        own = [r for r in runs if r[1] == name]
        assert len({r[0] for r in own}) >= 3 and {r[0][1] > 1 for r in own} == {False, True}, name
        assert {r[3]["recompute_activations"] for r in own} == {False, True}, name
    assert all(len({r[2] for r in runs if r[0] == mesh}) == min(PIPELINED, len(SCHEDULES)) for mesh in MESHES if mesh[1] > 1)
    assert any(mesh[1] > 1 for mesh in CLASSIFIER_RUNS), "the classifier must run through a pipeline too"
    names = run_names(MESHES) + run_names([(1, 1, 1)])
    assert len(set(names)) == len(names), "two runs share a case name"
    for tp, pp, dp in MESHES + [(1, 1, 1)]:  # full: families x schedules x ZeRO-2 x recompute x sp, all distinct
        full = [(n, schedule, tuple(o.items())) for n, schedule, o in variants(0, tp, pp, dp, full=True)]
        product = len(PRETRAINING) * (len(SCHEDULES) if pp > 1 else 1) * (2 if dp > 1 else 1) * 2 * (2 if tp > 1 else 1)
        assert len(set(full)) == len(full) == product + ((tp, pp, dp) in CLASSIFIER_RUNS), (tp, pp, dp)
