"""The 3D engine: on every mesh and schedule, 10 steps equal the single-rank run (one 8-rank spawn).

The references are plain single-process training (whole global batch, one backward, torch's
clip_grad_norm_, AdamW), computed once per model in a 1-rank spawn and handed to the 8 ranks,
which loop over the meshes and run the engine on each; the (1, 1, 1) mesh runs the engine in a
1-rank spawn. Models: GPT, BERT with its binary (sentence-order) head, and on two meshes BERT for
sequence classification. Coverage per (mesh, schedule), by default: GPT and BERT, each with a
different setting of ZeRO-1, recompute and sequence parallelism, alternating between schedules so
that every option value meets every mesh, schedule and model. With ``TPZOO_ENGINE_MATRIX=full``:
every combination of them (199 runs, about 16 minutes on 2 cores).
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch
import torch.distributed as dist

from tpzoo.engine.config import EngineConfig, check_fits
from tpzoo.engine.data_parallel import optimizer_state_bytes
from tpzoo.engine.train_step import Engine
from tpzoo.models import BertForSequenceClassification, BertModel, GPTModel, full_state_dict, get_preset
from tpzoo.parallel import init_mesh
from tpzoo.testing import spawn

G, S, VOCAB, STEPS, CLASSES = 16, 8, 101, 10, 3
TOL = 1e-5
# The final weights are compared per tensor: max |w - w_ref| / max |w_ref| <= TOL. AdamW's update
# lr m / (sqrt(v) + eps) normalises each gradient element, so where |g| is small it turns float32
# summation-order noise (engine and reference add the same numbers in different orders) into weight
# noise: with eps=1e-6, BERT tp=8 (all options) ended 1.3e-4 apart on head.lm_head.dense.weight,
# while the same run in float64 agrees to 1e-14 (no engine bug). eps=1e-4 makes elements with |g|
# below it SGD-like (update proportional to g: a wrong gradient still shows, noise is not blown
# up): that run's worst tensor drops to 1.5e-6.
LR, WD, CLIP, EPS = 3e-3, 0.01, 0.5, 1e-4
TINY = dict(num_layers=6, hidden_size=32, num_attention_heads=8, ffn_hidden_size=64, vocab_size=VOCAB,
            max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0, kernels="torch",
            num_labels=CLASSES)
MESHES = [(2, 2, 2), (1, 2, 4), (2, 4, 1), (4, 2, 1), (1, 8, 1), (1, 1, 8), (8, 1, 1)]  # (tp, pp, dp)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble")
KINDS = ("gpt", "bert", "bert-cls")
CLASSIFIER_RUNS = {(1, 2, 4): ("gpipe", True), (2, 4, 1): ("interleaved-zero-bubble", True),
                   (1, 1, 1): ("1f1b", False)}  # mesh: (schedule, every option on)
FULL = os.environ.get("TPZOO_ENGINE_MATRIX") == "full"


def model_config(kind: str, **changes):
    return get_preset("gpt-tiny" if kind == "gpt" else "bert-tiny", **{**TINY, **changes})


def build(kind: str, config, mesh, **stage):
    if kind == "gpt":
        return GPTModel(config, mesh, **stage)
    if kind == "bert":
        return BertModel(config, mesh, add_binary_head=True, **stage)
    return BertForSequenceClassification(config, mesh, **stage)


def global_batch(kind: str, step: int) -> dict[str, torch.Tensor]:
    """Sequences [step G, (step+1) G) of a seeded synthetic corpus, with ignored labels and BERT padding."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (G, S), generator=g)
    if kind == "gpt":
        labels = torch.cat([ids[:, 1:], torch.full((G, 1), -100)], 1)
        return dict(input_ids=ids, labels=labels)
    mask = torch.ones(G, S, dtype=torch.long)
    lengths = torch.randint(S // 2, S + 1, (G,), generator=g)
    mask[torch.arange(S) >= lengths[:, None]] = 0
    types = (torch.arange(S) >= S // 2).long().expand(G, S).clone()
    batch = dict(input_ids=ids, token_type_ids=types, attention_mask=mask)
    sequence_labels = torch.randint(0, CLASSES if kind == "bert-cls" else 2, (G,), generator=g)
    sequence_labels[step % G] = -100  # ignored: the sequence count is not G
    if kind == "bert-cls":
        return dict(batch, labels=sequence_labels)
    labels = torch.where((torch.rand(G, S, generator=g) < 0.3) & (mask == 1), ids, -100)
    return dict(batch, labels=labels, next_sentence_label=sequence_labels)


def loss_parts(out, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A single-rank model's outputs given ``batch``'s labels -> the mean loss of each label key (MLM
    tokens; BERT's binary head: sequences)."""
    keys = [k for k in ("labels", "next_sentence_label") if k in batch]
    return {k: t.sum() / (batch[k] != -100).sum() for t, k in zip(out if isinstance(out, tuple) else (out,), keys)}


def reference(kind: str) -> tuple[list[float], dict, list[float], list[dict[str, float]]]:
    """Single rank, no engine: the whole global batch in one forward, the mean loss of each label key
    (MLM tokens; BERT's binary head: sequences) added up, clip, AdamW; also each step's parts."""
    mesh = init_mesh()
    model = build(kind, model_config(kind), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms, parts = [], [], []
    for step in range(STEPS):
        b = global_batch(kind, step)
        by_key = loss_parts(model(**b), b)
        loss = sum(by_key.values())
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
        parts.append({k: v.item() for k, v in by_key.items()})
    state = {name: t.numpy() for name, t in full_state_dict(model).items()}  # numpy: crosses processes
    return losses, state, norms, parts


def references() -> dict:
    return {kind: reference(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def refs() -> dict:
    return spawn(references, 1)[0]


def stage_layers(pp: int, schedule: str) -> tuple[int, ...] | None:
    """6 layers cannot fill the 16 chunks of pp=8 interleaved evenly: one layer on each of the ranks
    between the embedding's and the head's, then a round of empty chunks (which pass hidden states on)."""
    return (0, 1, 1, 1, 1, 1, 1, 0) + (0,) * 8 if pp == 8 and schedule.startswith("interleaved") else None


def train(kind: str, mesh, schedule: str, steps: int = STEPS, **options) -> tuple[Engine, list]:
    """An engine on ``mesh`` with m = pp micro-batches per step (the fewest that keep every schedule
    busy; the pipelines accumulate over them); returns (engine, step results)."""
    model_options = {k: options.pop(k) for k in ("recompute_activations", "sequence_parallel") if k in options}
    config = model_config(kind, **model_options)
    engine = Engine(lambda **stage: build(kind, config, mesh, **stage), config,
                    EngineConfig(micro_batch_size=G // (mesh.dp_size * mesh.pp_size), global_batch_size=G,
                                 schedule=schedule, stage_layers=stage_layers(mesh.pp_size, schedule), lr=LR,
                                 weight_decay=WD, adam_eps=EPS, clip_grad=CLIP, **options), mesh)
    return engine, [engine.train_step(global_batch(kind, step)) for step in range(steps)]


def compare(engine: Engine, results, ref, tag: str, errors: dict) -> None:
    """Every step's loss, its part of each label key (BERT: MLM, sentence order) and gradient norm
    (before clipping) within TOL relative; every final weight tensor within TOL of that tensor's scale,
    max |w - w_ref| / max |w_ref| (see EPS)."""
    ref_losses, ref_state, ref_norms, ref_parts = ref
    for step, (r, loss, norm, parts) in enumerate(zip(results, ref_losses, ref_norms, ref_parts)):
        assert r.losses.keys() == parts.keys(), f"{tag}: step {step} loss parts {r.losses} vs {parts}"
        for what, got, expected in (("loss", r.loss, loss), ("grad norm", r.grad_norm, norm),
                                    *((f"{k} part", r.losses[k], v) for k, v in parts.items())):
            err = abs(got - expected) / abs(expected)
            errors[what] = max(errors.get(what, 0.0), err)
            assert err <= TOL, f"{tag}: step {step} {what} {got} vs single-rank {expected} (rel {err:.3g})"
    for chunk in engine.chunks:
        for name, t in full_state_dict(chunk.model, engine.mesh).items():
            source = "embedding.word_embeddings.weight" if name == "head.word_embeddings.weight" else name
            expected = torch.from_numpy(ref_state[source])
            err = (t - expected).abs().max().item() / expected.abs().max().item()
            if err > errors.get("weight", 0.0):
                errors["weight"], errors["worst weight"] = err, f"{tag} {name}"
            assert err <= TOL, f"{tag}: final {name} differs from single-rank (rel {err:.3g})"


def variants(index: int, tp: int, pp: int, dp: int, full: bool = FULL) -> list[tuple[str, str, dict]]:
    """(model, schedule, options) for mesh number ``index``.

    Default: one run per schedule, cycling through (GPT, all off), (BERT, all on), (GPT, on),
    (BERT, off), shifted per mesh, so that every mesh sees both models and both values of ZeRO-1,
    recompute and sequence parallelism, and so does every schedule. ``full``: every combination of
    model, schedule, ZeRO-1 (when dp > 1), recompute and sequence parallelism (when tp > 1).
    Both add the classifier's run on the meshes of CLASSIFIER_RUNS.
    """
    def options(zero: bool, recompute: bool, sp: bool) -> dict:
        return dict(use_distributed_optimizer=zero, recompute_activations=recompute, sequence_parallel=sp and tp > 1)

    if full:
        values = {True: (False, True), False: (False,)}
        out = [(kind, schedule, options(zero, recompute, sp))
               for kind, schedule, zero, recompute, sp in itertools.product(
                   ("gpt", "bert"), SCHEDULES if pp > 1 else ("1f1b",), values[dp > 1], (False, True), values[tp > 1])]
    else:
        rows = [("gpt", False), ("bert", True), ("gpt", True), ("bert", False)]
        schedules, shift = (SCHEDULES, index) if pp > 1 else (("1f1b", "1f1b"), 0)
        out = [(rows[(i + shift) % 4][0], schedule, options(*[rows[(i + shift) % 4][1]] * 3))
               for i, schedule in enumerate(schedules)]
    if (tp, pp, dp) in CLASSIFIER_RUNS:
        schedule, on = CLASSIFIER_RUNS[tp, pp, dp]
        out.append(("bert-cls", schedule, options(on and dp > 1, on, on)))
    return out


def adamw_bytes(engine: Engine) -> int:
    """What plain AdamW holds for this rank's parameters: two float32 moments and a step count each."""
    return sum(2 * p.numel() * 4 + 4 for p in engine.params)


def check_meshes(refs: dict, meshes: list[tuple[int, int, int]]) -> dict:
    """Every run of ``variants`` on each of ``meshes`` (tp, pp, dp) equals its single-rank reference."""
    errors: dict = {}
    zero: dict = {}  # dp -> (largest ZeRO-1 state on a rank, plain AdamW state on that rank)
    for index, (tp, pp, dp) in enumerate(meshes):
        mesh = init_mesh(tp=tp, pp=pp, dp=dp)
        for kind, schedule, options in variants(index, tp, pp, dp):
            tag = f"{kind} tp={tp} pp={pp} dp={dp} {schedule} {options}"
            t0 = time.perf_counter()
            engine, results = train(kind, mesh, schedule, **options)
            compare(engine, results, refs[kind], tag, errors)
            if dp > 1 and "zero-bubble" not in schedule:
                assert engine.reducer.overlapped == len(engine.reducer.buckets), f"{tag}: no overlap with backward"
            if dist.get_rank() == 0:
                print(f"{tag}: {time.perf_counter() - t0:.1f}s", flush=True)
            held = torch.tensor([optimizer_state_bytes(engine.optimizer), adamw_bytes(engine)])
            if options["use_distributed_optimizer"]:
                total = held.clone()
                dist.all_reduce(total[:1], group=mesh.dp_group)
                assert total[0] == held[1], f"{tag}: ZeRO-1 state over dp {total[0]} B != AdamW's {held[1]} B"
                dist.all_reduce(held, op=dist.ReduceOp.MAX)
                zero[dp] = tuple(held.tolist())
    return {"errors": errors, "zero": zero}


def test_engine_on_one_rank_equals_single_rank(refs):
    out = spawn(check_meshes, 1, refs, [(1, 1, 1)])
    print("max relative errors:", out[0]["errors"])


@pytest.mark.timeout(3600 if FULL else 900)
def test_engine_meshes_equal_single_rank(refs):
    t0 = time.perf_counter()
    out = spawn(check_meshes, 8, refs, MESHES, timeout=3600 if FULL else 600)
    print(f"{'full product' if FULL else 'pairwise'}: {time.perf_counter() - t0:.0f}s; max relative errors:",
          {what: max(o["errors"][what] for o in out) for what in ("loss", "grad norm")},
          max((o["errors"] for o in out), key=lambda e: e["weight"]))
    print("ZeRO-1 optimizer state, largest per rank vs plain AdamW on that rank (bytes):", out[0]["zero"])
    for dp, (held, plain) in out[0]["zero"].items():
        assert held <= 1.5 * plain / dp + 1024, f"dp={dp}: a rank holds {held} B of {plain} B, not about 1/{dp}"


def check_precision(refs: dict) -> dict:
    """fp16: an overflow injected on one rank skips the step on all and halves the scale; bf16 trains."""
    mesh = init_mesh(tp=2, pp=2, dp=2)
    engine, _ = train("gpt", mesh, "1f1b", steps=0, precision="fp16")
    before = [p.detach().clone() for p in engine.params]
    victim = engine.params[0]
    hook = victim.register_hook(lambda g: g * float("inf")) if dist.get_rank() == 5 else None
    scale = engine.loss_scale
    first = engine.train_step(global_batch("gpt", 0))
    if hook is not None:
        hook.remove()
    assert first.skipped and engine.skipped_steps == 1 and engine.loss_scale == scale / 2, \
        f"rank {dist.get_rank()}: the overflow step was not skipped everywhere (scale {engine.loss_scale})"
    assert all(torch.equal(p, b) for p, b in zip(engine.params, before)), "a skipped step changed weights"
    fp16 = [engine.train_step(global_batch("gpt", step)) for step in range(1, 4)]
    assert not any(r.skipped for r in fp16)
    _, bf16 = train("gpt", mesh, "interleaved-1f1b", steps=4, precision="bf16")
    ref = refs["gpt"][0]
    for name, results, offset in (("fp16", fp16, 1), ("bf16", bf16, 0)):
        for step, r in enumerate(results):
            err = abs(r.loss - ref[step + offset]) / ref[step + offset]
            assert err < 2e-2, f"{name} step {step + offset}: loss {r.loss} vs float32 {ref[step + offset]}"
    return {"bf16 losses": [r.loss for r in bf16], "fp16 skipped": engine.skipped_steps}


def test_engine_mixed_precision(refs):
    out = spawn(check_precision, 8, refs, timeout=300)
    print(out[0])


@pytest.mark.parametrize("changes, pp, dp, message", [
    (dict(global_batch_size=12, micro_batch_size=4), 1, 2, "global batch size 12 is not divisible by micro batch "
                                                             "size x dp = 4 x 2 = 8"),
    (dict(schedule="interleaved-1f1b", global_batch_size=8, micro_batch_size=2), 4, 2,
     "needs at least pp=4 micro-batches per step, got 2"),
    (dict(), 4, 1, "num_layers=7 cannot be split evenly into 4 pipeline stages"),
    (dict(stage_layers=(3, 3)), 2, 1, "stage_layers=(3, 3) must give 2 stages (pp x virtual stages) summing to "
                                      "num_layers=7"),
    (dict(schedule="gpipe", virtual_stages=2), 2, 1, "virtual_stages=2 needs an interleaved schedule"),
])
def test_engine_misuse_fails_before_work(changes, pp, dp, message):
    with pytest.raises(ValueError) as info:
        check_fits(EngineConfig(**changes), 7, pp, dp)
    assert message in str(info.value)


def test_engine_variants_cover_every_option_on_every_mesh_and_schedule():
    runs = [(mesh, kind, schedule, tuple(options.items())) for i, mesh in enumerate(MESHES)
            for kind, schedule, options in variants(i, *mesh, full=False) if kind != "bert-cls"]
    for option in ("use_distributed_optimizer", "recompute_activations", "sequence_parallel"):
        for mesh in MESHES:
            values = {dict(r[3])[option] for r in runs if r[0] == mesh}
            assert values == ({False, True} if option != "sequence_parallel" or mesh[0] > 1 else {False}), (mesh, option)
        for schedule in SCHEDULES:
            assert {dict(r[3])[option] for r in runs if r[2] == schedule} == {False, True}, (schedule, option)
    assert all({r[1] for r in runs if r[0] == mesh} == {"gpt", "bert"} for mesh in MESHES)
    assert all({r[1] for r in runs if r[2] == schedule} == {"gpt", "bert"} for schedule in SCHEDULES)
    assert any(mesh[1] > 1 for mesh in CLASSIFIER_RUNS), "the classifier must run through a pipeline too"
    for tp, pp, dp in MESHES + [(1, 1, 1)]:  # full: 2 models x schedules x ZeRO-1 x recompute x sp, all distinct
        full = [(kind, schedule, tuple(o.items())) for kind, schedule, o in variants(0, tp, pp, dp, full=True)]
        product = 2 * (len(SCHEDULES) if pp > 1 else 1) * (2 if dp > 1 else 1) * 2 * (2 if tp > 1 else 1)
        assert len(set(full)) == len(full) == product + ((tp, pp, dp) in CLASSIFIER_RUNS), (tp, pp, dp)


def test_split_layers_weighs_embedding_and_head():
    from tpzoo.engine.config import split_layers

    assert [len(r) for r in split_layers(14, 8)] == [1, 2, 2, 2, 2, 2, 2, 1]
    assert [len(r) for r in split_layers(8, 4)] == [2, 2, 2, 2]
    assert split_layers(5, 2, (1, 4)) == [range(0, 1), range(1, 5)]
