"""The model file of docs/new-model.md (neox.py: plain PyTorch, no tpzoo.parallel, with a LayerScale vector of
the author's) trained by the engine at tp 2, pp 2 and tp 2 x pp 2 x dp 2, each with and without sequence
parallelism, equals the same file trained as plain PyTorch in one process (every step's loss within 1e-5,
float32); and a parameter the sharding plan misdescribes stops the first step, never trains wrong.

One 8-rank spawn runs every case (each its own test, ``cases``); the reference is the plain model, torch's
AdamW and clip_grad_norm_, in a 1-rank spawn. The misdescribed parameter is ``tau``, a scalar multiplying the
queries of the attention (on this rank's heads): without sequence parallelism the plan keeps it whole, which
is wrong, and the first step refuses it naming the plan entry; with sequence parallelism, or with that entry
("partial"), it trains right. Styling the attention norms "partial" without sequence parallelism is the
opposite mistake (their gradients are whole on every rank), refused too.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from cases import CaseLog, assert_case
from doc_helpers import blocks
from torch import nn

from tpzoo.engine import Engine, EngineConfig
from tpzoo.engine.replicas import PlanError
from tpzoo.models import Attention, build_model
from tpzoo.parallel import ParallelPlan, ShardingPlan, init_mesh, manual_seed
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")



G, S, VOCAB, STEPS, TOL = 16, 16, 101, 5, 1e-5
LR, CLIP = 3e-3, 1.0
MESHES = {"tp2": (2, 1, 4), "pp2": (1, 2, 4), "tp2-pp2-dp2": (2, 2, 2)}


def model_file(name: str) -> str:
    """The block of docs/new-model.md that starts with ``# name``."""
    return next(b for b in blocks("new-model.md", "python") if b.startswith(f"# {name}\n"))


def neox(folder: str):
    """The page's neox.py, imported from ``folder`` (written there by the test)."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import neox as module
    return module


def config(folder: str):
    return neox(folder).NeoXConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                                   max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (G, S), generator=g)
    return dict(input_ids=ids, labels=torch.cat([ids[:, 1:], torch.full((G, 1), -100)], 1))


class TauAttention(Attention):
    """Attention whose queries are multiplied by a learned scalar ``tau``: a parameter on this rank's heads."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tau = nn.Parameter(torch.ones(1))

    def forward(self, x, mask=None, cache=None):
        qkv = self.query_key_value(x)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, -1, 3, self.head_dim)
        q = qkv[:, :, :, 0].transpose(1, 2) * self.tau
        k, v = (t.transpose(1, 2) for t in qkv[:, :, :, 1:].unbind(3))
        q, k = self.rotary(q, k)
        return self.dense(self.core_attention(q, k, v, mask).transpose(1, 2).reshape(b, s, -1))


def tau_model(folder: str, extra: dict[str, str] | None = None) -> type:
    """The page's NeoXModel with ``TauAttention`` in every layer (and ``extra`` plan entries)."""
    base = neox(folder).NeoXModel

    class TauModel(base):
        sharding = base.sharding | ShardingPlan(extra or {})

        def build_layer(self, layer_number):
            layer = super().build_layer(layer_number)
            c, rotary = self.config, layer.self_attention.rotary
            layer.self_attention = TauAttention(c.hidden_size, c.num_attention_heads, rotary=rotary,
                                                init_std=c.init_method_std, layer_number=layer_number)
            return layer

    return TauModel


def reference(folder: str, model: str) -> list[float]:
    """The plain model, one process: the whole batch, torch's AdamW and clip_grad_norm_."""
    cls = tau_model(folder) if model == "tau" else neox(folder).NeoXModel
    net = cls(config(folder))
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        b = batch(step)
        loss = net(**b).sum() / (b["labels"] != -100).sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses


def train(cls: type, folder: str, mesh, sp: bool) -> list[float]:
    manual_seed(1, mesh)
    c = config(folder)
    engine = Engine(functools.partial(build_model, cls, c), c,
                    EngineConfig(micro_batch_size=G // (mesh.dp_size * 2), global_batch_size=G, lr=LR, clip_grad=CLIP),
                    ParallelPlan(mesh, sequence_parallel=sp))
    return [engine.train_step(batch(step)).loss for step in range(STEPS)]


def equal(log: CaseLog, got: list[float], expected: list[float]) -> None:
    for step, (a, b) in enumerate(zip(got, expected)):
        log.close(torch.tensor(a), torch.tensor(b), f"step {step} loss", "loss", TOL)


def refused(log: CaseLog, run, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        run()


def case_names() -> list[str]:
    return ([f"{name}{'-sp' if sp else ''}" for name in MESHES for sp in (False, True)]
            + ["tau-tp2-refused", "tau-tp2-sp", "tau-tp2-partial", "norm-partial-refused"])


def checks(folder: str, refs: dict[str, list[float]]) -> CaseLog:
    log, plain = CaseLog(), neox(folder).NeoXModel
    for name, (tp, pp, dp) in MESHES.items():
        mesh = init_mesh(tp=tp, pp=pp, dp=dp)
        for sp in (False, True):
            with log.case(f"{name}{'-sp' if sp else ''}"):
                equal(log, train(plain, folder, mesh, sp), refs["neox"])
    mesh = init_mesh(tp=2)
    with log.case("tau-tp2-refused"):
        refused(log, lambda: train(tau_model(folder), folder, mesh, False),
                r"layers\.0\.self_attention\.tau, .*: replicated, but the gradient differs across the 2 "
                r"tensor-parallel ranks .* 'layers\.\*\.self_attention\.tau': 'partial'")
    with log.case("tau-tp2-sp"):
        equal(log, train(tau_model(folder), folder, mesh, True), refs["tau"])
    with log.case("tau-tp2-partial"):
        equal(log, train(tau_model(folder, {"layers.*.self_attention.tau": "partial"}), folder, mesh, False),
              refs["tau"])
    with log.case("norm-partial-refused"):
        cls = tau_model(folder, {"layers.*.self_attention.tau": "partial", "layers.*.attention_norm": "partial"})
        refused(log, lambda: train(cls, folder, mesh, False),
                r"layers\.0\.attention_norm\.weight, .*: the sharding plan sums its gradient over the 2 "
                r"tensor-parallel ranks, but every rank holds the same gradient .* 'replicated'")
    return log


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> list[CaseLog]:
    folder = tmp_path_factory.mktemp("neox")
    (folder / "neox.py").write_text(model_file("neox.py"))
    refs = spawn(_references, 1, str(folder))[0]
    return spawn(checks, 8, str(folder), refs, timeout=900)


def _references(folder: str) -> dict[str, list[float]]:
    return {"neox": reference(folder, "neox"), "tau": reference(folder, "tau")}


@pytest.mark.tier("unit")
def test_model_file_is_plain_pytorch():
    source = model_file("neox.py")
    assert "tpzoo.parallel" not in source and "mesh" not in source and "tp_" not in source
    assert "nn.Parameter" in source  # the LayerScale vectors: plain parameters the plan does not name


def test_every_case_ran(logs):
    assert logs[0].ran == case_names()


@pytest.mark.parametrize("name", case_names())
def test_new_model_matches_single_process(logs, name):
    assert_case(logs, name)


def _save_and_resume(folder: str, tmp: str) -> tuple[list[float], list[float], str]:
    """The page's model, never registered: the engine trains 4 steps saving after 2; a new engine loads that and
    trains steps 3-4 again; load_model by its class loads the weights (step 3's loss again), by name refuses it."""
    from tpzoo.checkpoint import load_checkpoint, load_model, save_checkpoint

    mesh, cls, c = init_mesh(), neox(folder).NeoXModel, config(folder)

    def engine() -> Engine:
        return Engine(functools.partial(build_model, cls, c), c, EngineConfig(micro_batch_size=4, global_batch_size=G),
                      mesh)

    first = engine()
    losses = [first.train_step(batch(step)).loss for step in range(2)]
    save_checkpoint(f"{tmp}/ckpt", 2, first, meta={})
    losses += [first.train_step(batch(step)).loss for step in (2, 3)]
    second = engine()
    load_checkpoint(f"{tmp}/ckpt", second)
    loaded = load_model(f"{tmp}/ckpt", mesh, model_class=cls)  # the class's config_class reads the config
    b = batch(2)
    with torch.no_grad():
        loss = (loaded(**b).sum() / (b["labels"] != -100).sum()).item()
    again = [second.train_step(batch(step)).loss for step in (2, 3)]
    assert abs(loss - again[0]) < 1e-6 * abs(loss), (loss, again[0])
    try:
        load_model(f"{tmp}/ckpt", mesh)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return losses[2:], again, refused


def test_a_model_of_ones_own_saves_and_resumes_through_the_engine_unregistered(tmp_path):
    folder = tmp_path / "neox"
    folder.mkdir()
    (folder / "neox.py").write_text(model_file("neox.py"))
    expected, resumed, refused = spawn(_save_and_resume, 1, str(folder), str(tmp_path))[0]
    assert resumed == expected, (resumed, expected)
    assert "the model is of family 'neox', which is not registered in this process; register its family" in refused
