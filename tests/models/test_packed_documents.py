"""Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss: ``tpzoo.data.documents``): a
batch of packed samples gives per-token losses and gradients equal, within 1e-5, to running each document alone,
in one process and with each sequence split over cp 2 and 4 context-parallel ranks (both attention modes), for a
learned-position family (GPT) and a rotary one (Llama); in one process also a block of queries at a time (the path of
sequences longer than ``QUERY_BLOCK``, here made 16 tokens: never an [s, s] mask), with SDPA and the fused softmax,
as a2a attends the gathered sequence.
One spawn of 4 ranks; each check a named case."""

from __future__ import annotations

import contextlib
import pytest
import torch
import torch.distributed as dist
from cases import CaseLog, assert_case
from families import CAUSAL_LM, GQA_LM

from tpzoo.data.documents import DocumentMarks
from tpzoo import placement
from tpzoo.engine.context_cut import cut_sequences
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.testing import spawn

pytestmark = pytest.mark.tier("distributed")

B, S, VOCAB, EOD = 2, 48, 97, 3
FAMILIES = {"gpt": CAUSAL_LM, "llama": GQA_LM}
MESHES = [(1, "p2p"), (2, "p2p"), (2, "a2a"), (4, "p2p"), (4, "a2a")]
BACKENDS = ("sdpa", "fused-softmax")
NAMES = [f"{name}-cp{cp}-{comm}" for name in FAMILIES for cp, comm in MESHES] + [
    f"{name}-query-blocks-{backend}" for name in FAMILIES for backend in BACKENDS]


def packed_batch() -> dict[str, torch.Tensor]:
    """B windows of S + 1 tokens with end-of-document ids at seeded places (documents of 1 to ~20 tokens, one
    running past the window's end), as the three flags mark them."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(EOD + 1, VOCAB, (B, S + 1), generator=g)
    tokens[torch.rand(B, S + 1, generator=g) < 0.12] = EOD
    tokens[0, 0] = EOD  # a document of one token
    marks = DocumentMarks(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    samples = [marks({"input_ids": row[:-1], "labels": row[1:]}) for row in tokens]
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def alone(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, S] per-token losses of each document run by itself (a batch of one sequence, no packing flags)."""
    out = torch.zeros(B, S)
    for b in range(B):
        docs = batch["document_ids"][b]
        for d in docs.unique():
            at = (docs == d).nonzero().flatten()
            out[b, at] = model(batch["input_ids"][b, at][None], labels=batch["labels"][b, at][None])[0]
    return out


def check(log: CaseLog, name: str, cp: int, comm: str, batch: dict[str, torch.Tensor], backend: str = "auto") -> None:
    case = FAMILIES[name]
    config = case.config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=VOCAB,
                         max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0)
    whole = case.build(config, ParallelPlan(init_mesh(), kernels="torch"))  # whole on every rank (dp 4)
    expected = alone(whole, batch)
    expected.sum().backward()
    mesh = init_mesh(cp=cp)
    model = case.build(config, ParallelPlan(mesh, kernels="torch", cp_comm_type=comm, attention_backend=backend))
    mine = cut_sequences(batch, cp, mesh.cp_rank, balanced=True) if cp > 1 else batch
    losses = model(**mine)
    losses.sum().backward()
    full = torch.zeros(B, S)
    full[:, mine.get("sequence_index", torch.arange(S))] = losses.detach()
    dist.all_reduce(full, group=mesh.cp_group)  # each rank's tokens in place
    log.close(full, expected.detach(), "per-token losses", "loss")
    for (key, p), q in zip(model.named_parameters(), whole.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.cp_group)  # the cp ranks' partial sums
        log.close(grad, q.grad, f"gradient of {key}", "grad")


def checks() -> CaseLog:
    log, batch = CaseLog(), packed_batch()
    assert (batch["labels"] == -100).any() and batch["document_ids"].max() >= 3
    for name in FAMILIES:
        for cp, comm in MESHES:
            with log.case(f"{name}-cp{cp}-{comm}"), blocks_of(16 if comm == "a2a" else placement.QUERY_BLOCK):
                check(log, name, cp, comm, batch)  # a2a: the gathered sequence's mask, 16 queries at a time
        for backend in BACKENDS:
            with log.case(f"{name}-query-blocks-{backend}"), blocks_of(16):
                check(log, name, 1, "p2p", batch, backend)
    return log


@contextlib.contextmanager
def blocks_of(size: int):
    """Attention of packed documents a block of ``size`` queries at a time (``QUERY_BLOCK``), within the block."""
    before, placement.QUERY_BLOCK = placement.QUERY_BLOCK, size
    try:
        yield
    finally:
        placement.QUERY_BLOCK = before


@pytest.fixture(scope="module")
def logs() -> list[CaseLog]:
    return spawn(checks, 4)


@pytest.mark.parametrize("name", NAMES)
def test_packed_documents_equal_each_document_alone(logs, name):
    assert_case(logs, name)


@pytest.mark.tier("unit")
def test_document_marks_follow_megatron():
    ids = torch.tensor([5, 6, EOD, 7, 8, 9, EOD, 4])
    sample = DocumentMarks(EOD, True, True, True)({"input_ids": ids, "labels": torch.arange(8)})
    assert sample["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    assert sample["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert sample["labels"].tolist() == [0, 1, -100, 3, 4, 5, -100, 7]
    mask_only = DocumentMarks(EOD, reset_attention_mask=True)({"input_ids": ids, "labels": torch.arange(8)})
    assert mask_only["position_ids"].tolist() == list(range(8)) and mask_only["labels"].tolist() == list(range(8))
    assert DocumentMarks(EOD)({"input_ids": ids, "labels": ids}).keys() == {"input_ids", "labels"}
    with pytest.raises(ValueError, match="end-of-document id"):
        DocumentMarks(None)
