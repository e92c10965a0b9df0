"""Checkpoints: save on (tp, pp, dp) = (2, 2, 2), resume on other meshes exactly, atomic saves, load_model.

One 8-rank spawn trains three runs 5 steps each on (2, 2, 2), saving after step 3: GPT (fp32, ZeRO-1),
BERT (fp16 weights with loss scaling, plain AdamW) and GPT with dropout (bf16 weights, ZeRO-1). Then
on (4, 2, 1) and (1, 4, 2) (ZeRO-1 on or off) a fresh engine loads the GPT and BERT checkpoints: full
(main, float32) weights and every parameter's optimizer state equal the saved ones bit for bit, the
model's fp16 weights are their cast, and 2 more steps give the uninterrupted run's losses; the
dropout run resumes on (2, 2, 2) without ZeRO-1, with its RNG, and matches exactly. ``load_model``
rebuilds the saved models at tp 1 and 2 and as pipeline stages. A 1-rank spawn resumes on (1, 1, 1)
and checks atomicity, errors and model folders.
"""

from __future__ import annotations

import functools

import logging
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn
import torch.distributed as dist

from tpzoo.checkpoint import latest_iteration, load_checkpoint, load_model, read_meta, resolve_checkpoint, save_checkpoint
from tpzoo.engine import Engine, EngineConfig
from families import CAUSAL_LM_UNTIED, CLASSIFIER, MASKED_LM, Case, hf_class
from tpzoo.models import full_state_dict
from tpzoo.models.pretrained import save_pretrained
from tpzoo.models.sharding import gather_full, load_full_state_dict, source_name, tp_partitions
from tpzoo.parallel import ParallelPlan, init_mesh, manual_seed
from tpzoo.parallel.fsdp import local
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")



G, S, SAVE_AT, STEPS = 16, 8, 3, 5
LR, WD, CLIP, EPS = 3e-3, 0.01, 0.5, 1e-6
# the causal LM unties its output layer (a second padded vocabulary tensor), the masked LM ties it (a copy
# on the last pipeline stage) and has a vocabulary-parallel bias; runs and folders are named by family
CAUSAL, MASKED = CAUSAL_LM_UNTIED, MASKED_LM
VOCAB = {CAUSAL.inputs: 500, MASKED.inputs: 101}  # not multiples of 128: the padded vocabulary differs per tp
# run: (model, precision, ZeRO-1 when saving, dropout)
RUNS = {CAUSAL.family: (CAUSAL, "fp32", True, 0.0), MASKED.family: (MASKED, "fp16", False, 0.0),
        "dropout": (CAUSAL, "bf16", True, 0.1)}
RESUMES = {(4, 2, 1): {CAUSAL.family: False, MASKED.family: False},  # ZeRO-1 on resume
           (1, 4, 2): {CAUSAL.family: False, MASKED.family: True}}
FP16_TOL = 2e-5  # fp16 weights: another tp rounds the matmuls differently (measured 6e-6)


def model_config(case: Case, dropout: float = 0.0):
    return case.config(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                       vocab_size=VOCAB[case.inputs], max_position_embeddings=16, hidden_dropout=dropout,
                       attention_dropout=dropout)


def plan(mesh) -> ParallelPlan:
    return ParallelPlan(mesh, kernels="torch")


def batch(case: Case, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB[case.inputs], (G, S), generator=g)
    if case.inputs == "causal-lm":
        return dict(input_ids=ids, labels=torch.cat([ids[:, 1:], torch.full((G, 1), -100)], 1))
    mask = (torch.arange(S) < torch.randint(S // 2, S + 1, (G, 1), generator=g)).long()
    labels = torch.where((torch.rand(G, S, generator=g) < 0.3) & (mask == 1), ids, -100)
    return dict(input_ids=ids, labels=labels, token_type_ids=(torch.arange(S) >= S // 2).long().expand(G, S).clone(),
                attention_mask=mask)


def make_engine(run: str, mesh, zero: bool) -> Engine:
    case, precision, _, dropout = RUNS[run]
    config = model_config(case, dropout)
    return Engine(functools.partial(case.build, config), config,
                  EngineConfig(micro_batch_size=G // (mesh.dp_size * mesh.pp_size), global_batch_size=G, lr=LR,
                               weight_decay=WD, adam_eps=EPS, clip_grad=CLIP, precision=precision,
                               initial_loss_scale=2.0**10, use_distributed_optimizer=zero), plan(mesh))


def train(engine: Engine, run: str, steps: range) -> list[float]:
    return [engine.train_step(batch(RUNS[run][0], step)).loss for step in steps]


def gathered_state(engine: Engine) -> tuple[dict, dict]:
    """(full main weights, full optimizer states by parameter) of the whole model, merged over all ranks
    (a ZeRO-1 rank holds the main weights and states of the parameters it owns). Checks on the way that
    each model weight is its main weight in the model's dtype."""
    mesh, inner = engine.mesh, engine.optimizer
    weights, optim = {}, {}
    for chunk in engine.chunks:
        partitions = tp_partitions(chunk.model, mesh.tp_size)
        mains = {k: v for k, v in engine.main.weights(chunk.model).items() if v is not None}
        weights.update({k: v.numpy() for k, v in gather_full(mains, partitions, mesh).items()})
        for name, p in chunk.model.named_parameters():
            if name in mains:
                # local: torch.equal of DTensors (FSDP) all-reduces over the whole world, not the mesh
                assert torch.equal(local(p), local(mains[name]).to(p.dtype)), \
                    f"model weight {name} is not its main weight"
            p = engine.main.main_of(p)
            if p in inner.state:
                state = inner.state[p]
                parts = {k: partitions[name] for k, v in state.items() if name in partitions and v.shape == p.shape}
                optim[name] = {k: v.numpy() for k, v in gather_full(state, parts, mesh).items()}
    merged = [None] * dist.get_world_size()
    dist.all_gather_object(merged, (weights, optim))
    return {k: v for w, _ in merged for k, v in w.items()}, {k: v for _, o in merged for k, v in o.items()}


def assert_same_state(engine: Engine, saved: tuple[dict, dict], tag: str) -> None:
    """Bitwise: every weight and every parameter's optimizer state (a tied copy against the embedding's)."""
    for now, before, what in zip(gathered_state(engine), saved, ("weights", "optimizer state")):
        assert {source_name(k) for k in now} == {source_name(k) for k in before}, f"{tag}: {what} names differ"
        for name, value in now.items():
            ref = before[source_name(name)]
            same = (all(np.array_equal(value[k], ref[k]) for k in ref) and value.keys() == ref.keys()
                    if isinstance(ref, dict) else np.array_equal(value, ref))
            assert same, f"{tag}: {what} of {name} differs from the saved one"


def check_losses(got: list[float], expected: list[float], tol: float, tag: str, errors: dict) -> None:
    for step, (a, b) in enumerate(zip(got, expected), SAVE_AT):
        err = abs(a - b) / abs(b)
        errors[tag] = max(errors.get(tag, 0.0), err)
        assert err <= tol, f"{tag}: step {step} loss {a} vs uninterrupted {b} (rel {err:.3g})"


def uninterrupted(root: str) -> dict:
    """The three runs on (2, 2, 2): 5 steps, saved after step 3; their losses and saved states."""
    mesh = init_mesh(tp=2, pp=2, dp=2)
    refs = {}
    for run, (_, _, zero, _) in RUNS.items():
        manual_seed(7, mesh)
        engine = make_engine(run, mesh, zero)
        first = train(engine, run, range(SAVE_AT))
        t0 = time.perf_counter()
        save_checkpoint(f"{root}/{run}", SAVE_AT, engine, meta={"consumed_samples": SAVE_AT * G, "run": run})
        seconds = time.perf_counter() - t0
        refs[run] = dict(state=gathered_state(engine), rng=torch.get_rng_state(), save_s=seconds,
                         scaler=engine.scaler.state_dict() if engine.scaler else None,
                         losses=first + train(engine, run, range(SAVE_AT, STEPS)))
    return refs


def resume(root: str, run: str, mesh, zero: bool, ref: dict, tol: float, errors: dict, timing: dict) -> Engine:
    manual_seed(99, mesh)  # another seed: only a restored RNG gives the uninterrupted run's dropout masks
    engine = make_engine(run, mesh, zero)
    t0 = time.perf_counter()
    meta = load_checkpoint(f"{root}/{run}", engine)
    timing[f"load {run} {mesh.tp_size, mesh.pp_size, mesh.dp_size}"] = time.perf_counter() - t0
    tag = f"{run} resumed on tp={mesh.tp_size} pp={mesh.pp_size} dp={mesh.dp_size} zero={zero}"
    assert meta["iteration"] == SAVE_AT and meta["consumed_samples"] == SAVE_AT * G and meta["run"] == run, meta
    same_mesh = meta["checkpoint"]["mesh"] == {"pp": mesh.pp_size, "dp": mesh.dp_size, "tp": mesh.tp_size}
    assert torch.equal(torch.get_rng_state(), ref["rng"]) == same_mesh, f"{tag}: RNG restored iff on the same mesh"
    assert_same_state(engine, ref["state"], tag)
    assert (engine.scaler.state_dict() if engine.scaler else None) == ref["scaler"], tag
    check_losses(train(engine, run, range(SAVE_AT, STEPS)), ref["losses"][SAVE_AT:], tol, tag, errors)
    return engine


def logits(model, case: Case) -> torch.Tensor:
    b = batch(case, 99)
    extras = {k: v for k, v in b.items() if k not in ("input_ids", "labels")}
    with torch.no_grad():
        return model.eval()(b["input_ids"], **extras)


def check_load_model(root: str, refs: dict) -> dict:
    """load_model at tp 1 and 2 gives the trained model's logits; pipeline stages; a new head for the masked LM."""
    out = {}
    reference = CAUSAL.build(model_config(CAUSAL), plan(init_mesh(tp=1)))
    load_full_state_dict(reference, {k: torch.from_numpy(v) for k, v in refs[CAUSAL.family]["state"][0].items()
                                     if not k.startswith("head.word")})
    expected = logits(reference, CAUSAL)
    for tp in (1, 2):
        got = logits(load_model(f"{root}/{CAUSAL.family}/iter_0000003", plan(init_mesh(tp=tp))), CAUSAL)
        out[f"load_model tp={tp} logits rel err"] = err = ((got - expected).abs().max() / expected.abs().max()).item()
        assert err <= (0 if tp == 1 else 1e-5), f"tp={tp}: logits differ by {err:.3g}"
    stage = load_model(f"{root}/{MASKED.family}", plan(init_mesh(tp=2, pp=4, dp=1)))
    assert len(stage.layers) == 1 and stage.pre_process == (stage.mesh.pp_rank == 0)
    for name, value in full_state_dict(stage).items():
        assert np.array_equal(value.numpy(), refs[MASKED.family]["state"][0][source_name(name)]), name
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("tpzoo.checkpoint").addHandler(handler)
    clf = load_model(f"{root}/{MASKED.family}", plan(init_mesh(tp=2)), model_class=CLASSIFIER.model_class,
                     config_overrides={"num_labels": 3})
    assert clf.config.num_labels == 3 and logits(clf, MASKED).shape == (G, 3)
    assert len(records) == 1 and "2 parameters" in records[0] and "head.classifier.bias, head.classifier.weight" \
        in records[0], records
    for name, value in full_state_dict(clf).items():
        if not name.startswith("head.classifier"):  # the pooler comes from the masked LM's binary head
            assert np.array_equal(value.numpy(), refs[MASKED.family]["state"][0][name]), name
    return out


def eight_ranks(root: str) -> dict:
    refs = uninterrupted(root)
    errors: dict = {}
    timing = {f"save {run}": ref["save_s"] for run, ref in refs.items()}
    for (tp, pp, dp), zeros in RESUMES.items():
        mesh = init_mesh(tp=tp, pp=pp, dp=dp)
        for run, zero in zeros.items():
            resume(root, run, mesh, zero, refs[run], 1e-6 if run == CAUSAL.family else FP16_TOL, errors, timing)
    mesh = init_mesh(tp=2, pp=2, dp=2)
    engine = resume(root, "dropout", mesh, False, refs["dropout"], 0.0, errors, timing)
    bf16 = dict(model=sorted({str(p.dtype) for p in engine.params}),
                main=sorted({str(p.dtype) for p in engine.main.params}), weights=len(refs["dropout"]["state"][0]))
    errors.update(check_load_model(root, refs))
    return dict(refs=refs, errors=errors, timing=timing, bf16=bf16)



def one_rank(root: str, refs: dict) -> dict:
    """(1, 1, 1): resume both; atomicity of a save that fails; errors; load_model from a model folder."""
    errors: dict = {}
    timing: dict = {}
    mesh = init_mesh()
    resume(root, MASKED.family, mesh, False, refs[MASKED.family], FP16_TOL, errors, timing)
    engine = resume(root, CAUSAL.family, mesh, True, refs[CAUSAL.family], 1e-6, errors, timing)

    import tpzoo.checkpoint.save as save_module

    save_dir = f"{root}/atomic"
    save_checkpoint(save_dir, 1, engine, meta={})
    publish = save_module.publish

    def dies(partial, final):
        raise RuntimeError("killed before publishing")

    save_module.publish = dies
    with pytest.raises(RuntimeError, match="killed before publishing"):
        save_checkpoint(save_dir, 2, engine, meta={})
    save_module.publish = publish
    assert (resolve_checkpoint(save_dir).name, latest_iteration(save_dir)) == ("iter_0000001", 1)
    assert (resolve_checkpoint(save_dir).parent / "iter_0000002.partial").is_dir()
    assert load_checkpoint(save_dir, engine)["iteration"] == 1
    for iteration in (3, 3):  # the second save of 3 replaces the first
        save_checkpoint(save_dir, iteration, engine, meta={"again": iteration})
    names = sorted(p.name for p in resolve_checkpoint(save_dir).parent.iterdir())
    assert names == ["iter_0000001", "iter_0000003", "latest"], names

    masked = make_engine(MASKED.family, mesh, False)
    with pytest.raises(ValueError, match=rf"another model than the engine's \(class: checkpoint {CAUSAL.model}, model "
                                         rf"{MASKED.model}; options: .*; model_type: checkpoint '{CAUSAL.family}', "
                                         rf"model '{MASKED.family}'; vocab_size: checkpoint 500, model 101"):
        load_checkpoint(save_dir, masked)
    with pytest.raises(FileNotFoundError, match=f"checkpoint {root}/missing does not exist"):
        load_checkpoint(f"{root}/missing", masked)
    with pytest.raises(ValueError, match=f"{root} holds no tpzoo checkpoint; a training checkpoint is"):
        load_model(root)

    folder = save_pretrained(load_model(f"{root}/{CAUSAL.family}"), f"{root}/folder")
    again = load_model(folder)
    for name, value in full_state_dict(again).items():
        assert np.array_equal(value.numpy(), refs[CAUSAL.family]["state"][0][name]), name
    with pytest.raises(ValueError, match="is a model folder .* load its weights with tpzoo.checkpoint.load_model"):
        load_checkpoint(folder, engine)
    return dict(errors=errors, timing=timing)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("checkpoints")
    t0 = time.perf_counter()
    out = spawn(eight_ranks, 8, str(root), timeout=600)[0]
    out["timing"]["8-rank spawn"] = time.perf_counter() - t0
    return root, out


def test_resume_on_other_meshes_is_exact(trained):
    root, out = trained
    print("max relative errors:", out["errors"], "\nseconds:", {k: round(v, 2) for k, v in out["timing"].items()})
    meta = read_meta(root / CAUSAL.family)  # no process group needed
    assert meta["iteration"] == 3 and meta["checkpoint"]["mesh"] == {"pp": 2, "dp": 2, "tp": 2}
    assert meta["checkpoint"]["model"]["class"] == CAUSAL.model and meta["checkpoint"]["optimizer"]["zero"]
    assert read_meta(root / MASKED.family)["checkpoint"]["loss_scaler"]["scale"] == 2.0**10


def test_bf16_resume_restores_main_weights_bitwise(trained):
    """The bf16 run (ZeRO-1 when saved, not when resumed) resumed its float32 main weights bit for bit
    (``assert_same_state`` in the spawn) and its losses exactly."""
    _, out = trained
    assert out["bf16"]["model"] == ["torch.bfloat16"] and out["bf16"]["main"] == ["torch.float32"], out["bf16"]
    assert out["bf16"]["weights"] > 0 and out["errors"]["dropout resumed on tp=2 pp=2 dp=2 zero=False"] == 0.0


def test_single_rank_resume_atomic_saves_and_errors(trained):
    root, out = trained
    result = spawn(one_rank, 1, str(root), out["refs"], timeout=300)[0]
    print("max relative errors:", result["errors"], "\nseconds:", result["timing"])


@pytest.mark.tier("journey")
def test_doc_commands_generate_and_convert_a_checkpoint(trained, tmp_path):
    """docs/checkpoints.md runs as shown, ``ckpt`` being the causal LM saved on (2, 2, 2): generation gives
    the same greedy text at tp=1 and tp=2, and to-hf writes the checkpoint's weights."""
    from doc_helpers import blocks, run

    from real_text import documents, write_jsonl

    from tpzoo.data.tokenizer import train_tokenizer

    root, out = trained
    (tmp_path / "ckpt").symlink_to(root / CAUSAL.family)
    # a tokenizer of the checkpoint's vocabulary (generate refuses one of another size)
    text = write_jsonl(tmp_path / "text.jsonl", documents())
    (tmp_path / "tok.model").symlink_to(train_tokenizer([str(text)], str(tmp_path / "tok500"), VOCAB[CAUSAL.inputs]))
    for code in blocks("checkpoints.md", "python"):
        done = run([sys.executable, "-c", code], tmp_path)
        assert done.returncode == 0, f"python block failed:\n{done.stderr[-3000:]}"
    outputs = {}
    for command in (line for block in blocks("checkpoints.md", "bash") for line in block.splitlines()):
        done = run(["bash", "-c", command], tmp_path)
        assert done.returncode == 0, f"`{command}` failed:\n{done.stderr[-3000:]}"
        outputs[command.split()[0]] = outputs.get(command.split()[0], []) + [done.stdout.strip()]
    one, two = outputs["python"][0], outputs["torchrun"][0]
    assert one.startswith("the cat") and len(one) > len("the cat") and two == one, (one, two)
    hf = hf_class(CAUSAL).from_pretrained(tmp_path / "ckpt-hf")
    assert np.array_equal(hf.transformer.wte.weight.detach().numpy(),
                          out["refs"][CAUSAL.family]["state"][0]["embedding.word_embeddings.weight"])


@pytest.mark.tier("unit")
def test_convert_misuse_is_one_line(tmp_path, capsys):
    from tpzoo.convert.__main__ import main

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["to-hf", str(tmp_path / "empty"), str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and "empty holds no tpzoo checkpoint" in lines[0], lines


@pytest.mark.tier("unit")
def test_loaded_adamw_step_lives_where_a_fused_update_reads_it():
    """A fused or capturable AdamW (the engine's on CUDA) reads ``step`` on the parameter's device: the
    loaded one goes there (meta stands in for the GPU), a plain group's stays on the host."""
    from types import SimpleNamespace

    from tpzoo.checkpoint.optimizer import install_states

    on_device, on_host = nn.Parameter(torch.zeros(3, device="meta")), nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([{"params": [on_device], "capturable": True}, {"params": [on_host]}])
    states = {p: {"step": torch.tensor(7.0, dtype=torch.float64), "exp_avg": torch.zeros_like(p)}
              for p in (on_device, on_host)}
    install_states(SimpleNamespace(optimizer=optimizer), states)
    step = optimizer.state[on_device]["step"]
    assert step.device.type == "meta" and step.dtype == torch.float32
    assert optimizer.state[on_host]["step"].device.type == "cpu"
