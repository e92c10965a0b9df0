"""Forward-only evaluation through the engine equals the single-rank model (one 8-rank spawn).

With dropout on in the config: the engine's chunks must run in eval mode (the references do) and
return to train mode afterwards. Meshes (tp, pp, dp): (2, 2, 2), (1, 4, 2) plain and interleaved
with virtual stages (some chunks empty), (2, 1, 4); sequence parallelism on one tp=2 mesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from test_engine import G, S, build, global_batch, loss_parts, model_config
from tpzoo.engine.config import EngineConfig
from tpzoo.engine.evaluate import eval_logits, eval_loss, eval_losses, forward_only
from tpzoo.engine.train_step import Engine
from tpzoo.models import BertForSequenceClassification
from tpzoo.parallel import init_mesh
from tpzoo.testing import spawn

LABELS = 3
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
# (tp, pp, dp, schedule, sequence parallel)
RUNS = [(2, 2, 2, "1f1b", True), (1, 4, 2, "1f1b", False), (1, 4, 2, "interleaved-1f1b", False),
        (2, 1, 4, "1f1b", False)]


def classification_batch() -> dict[str, torch.Tensor]:
    """BERT inputs with labels [G], one of them ignored (-100)."""
    batch = {k: v for k, v in global_batch("bert", 7).items() if k != "next_sentence_label"}
    labels = torch.randint(0, LABELS, (G,), generator=torch.Generator().manual_seed(5))
    labels[3] = -100
    return {**batch, "labels": labels}


def build_model(kind: str, config, mesh, **stage):
    return BertForSequenceClassification(config, mesh, **stage) if kind == "clf" else build(kind, config, mesh,
                                                                                                **stage)


def config_of(kind: str, **changes):
    return model_config("bert" if kind == "clf" else kind, **DROPOUT, num_labels=LABELS, **changes)


def batch_of(kind: str) -> dict[str, torch.Tensor]:
    return classification_batch() if kind == "clf" else global_batch(kind, 0)


def references() -> dict:
    """Single rank, eval mode: mean loss of GPT and BERT (MLM + sentence order) and its part of each label key,
    classifier logits and mean loss."""
    mesh = init_mesh()
    out = {}
    with torch.no_grad():
        for kind in ("gpt", "bert", "clf"):
            model = build_model(kind, config_of(kind), mesh).eval()
            b = batch_of(kind)
            if kind == "clf":
                logits = model(**{k: v for k, v in b.items() if k != "labels"})
                loss = F.cross_entropy(logits, b["labels"]).item()
                out[kind] = (loss, logits.numpy(), {"labels": loss})
            else:
                parts = loss_parts(model(**b), b)
                out[kind] = (sum(parts.values()).item(), None, {k: v.item() for k, v in parts.items()})
    return out


def check(refs: dict) -> dict:
    errors = {"loss": 0.0, "logits": 0.0}
    for tp, pp, dp, schedule, sp in RUNS:
        mesh = init_mesh(tp=tp, pp=pp, dp=dp)
        for kind in ("gpt", "bert", "clf"):
            tag = f"{kind} tp={tp} pp={pp} dp={dp} {schedule} sp={sp}"
            config = config_of(kind, sequence_parallel=sp)
            engine = Engine(lambda **stage: build_model(kind, config, mesh, **stage), config,
                            EngineConfig(micro_batch_size=G // (dp * pp), global_batch_size=G, schedule=schedule),
                            mesh)
            batch = batch_of(kind)
            before = [p.detach().clone() for p in engine.params]
            loss = eval_loss(engine, batch)
            total, parts = eval_losses(engine, batch)
            ref_loss, ref_logits, ref_parts = refs[kind]
            assert total == loss and parts.keys() == ref_parts.keys(), f"{tag}: eval_losses {total}, {parts}"
            for what, got, expected in (("eval_loss", loss, ref_loss), *((f"{k} part", parts[k], v)
                                                                         for k, v in ref_parts.items())):
                err = abs(got - expected) / abs(expected)
                errors["loss"] = max(errors["loss"], err)
                assert err <= 1e-6, f"{tag}: {what} {got} vs single-rank {expected} (rel {err:.3g})"
            if kind == "clf":
                logits = eval_logits(engine, batch)
                assert logits.shape == (G, LABELS), f"{tag}: logits {tuple(logits.shape)}"
                err = (logits - torch.from_numpy(ref_logits)).abs().max().item()
                errors["logits"] = max(errors["logits"], err)
                assert err <= 1e-5, f"{tag}: logits differ from single-rank by {err:.3g}"
            elif kind == "gpt" and pp > 1:
                outs = forward_only(engine, batch)  # per-token losses reach every pp rank
                assert [tuple(o.shape) for (o,) in outs] == [(G // (dp * pp), S)] * engine.m, f"{tag}: {outs}"
            assert all(c.training for c in engine.chunks), f"{tag}: train mode not restored"
            assert all(torch.equal(p, b) for p, b in zip(engine.params, before)), f"{tag}: weights changed"
            if dist.get_rank() == 0:
                print(f"{tag}: ok", flush=True)
    return errors


def test_forward_only_equals_single_rank():
    refs = spawn(references, 1)[0]
    out = spawn(check, 8, refs, timeout=300)
    print("max errors (loss relative, logits absolute):", {k: max(o[k] for o in out) for k in out[0]})
