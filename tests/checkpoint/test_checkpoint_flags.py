"""Megatron-LM's checkpoint flags (tpzoo.training.checkpoint_args) and the save/load options under them:
a checkpoint saved without its optimizer state or RNG states says so and loads only with the flags that
skip them; a vocabulary padded to another multiple at tp 2 loads at tp 1; ``--save DIR --load DIR``
starts a first run from scratch; ``--finetune`` takes the weights only. One spawn of 2 ranks and two
single-process pretrain.py runs, in the background."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import background
from cases import CaseLog, assert_case
from families import CAUSAL_LM, batch
from pretrain_helpers import TINY, command, metrics, run
from tpzoo.checkpoint import load_checkpoint, read_meta, save_checkpoint
from tpzoo.engine import Engine, EngineConfig
from tpzoo.models import full_state_dict
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.training.fits import estimated_state_bytes
from tpzoo.training.run_summary import state_bytes

pytestmark = pytest.mark.tier("journey")



SIZES = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=500,
             max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False)
MULTIPLE = 7  # 500 tokens: padded to 504 at tp 2 (a multiple of 14), to 512 at tp 1 with the default 128
RANK_CASES = ("padded-vocab-tp2", "meta-says-what-was-saved", "no-optimizer-names-no-load-optim",
              "no-rng-names-no-load-rng", "tp2-padding-loads-at-tp1", "full-checkpoint-loads-optimizer",
              "rng-warning-only-with-dropout", "memory-estimate-matches-the-engines")
CLI_CASES = ("first-run-starts-from-scratch", "no-save-flags-in-meta", "resume-without-optimizer-exits-early",
             "finetune-takes-the-weights-only")


def engine(config, mesh) -> Engine:
    case = CAUSAL_LM
    return Engine(lambda plan, **stage: case.build(config, plan, **stage), config,
                  EngineConfig(micro_batch_size=2 // mesh.dp_size, global_batch_size=2), ParallelPlan(mesh))


def rank_checks(root: str) -> CaseLog:
    """At tp 2: train a step, save without optimizer and RNG and with both; at tp 1 (dp 2, default padding) load."""
    log, root = CaseLog(), Path(root)
    case = CAUSAL_LM
    config = case.config(**SIZES, make_vocab_size_divisible_by=MULTIPLE)
    g = torch.Generator().manual_seed(0)
    tp2 = engine(config, init_mesh(tp=2))
    tp2.train_step(batch(case, torch.randint(0, 500, (2, 8), generator=g), g))
    with log.case("padded-vocab-tp2"):
        assert tp2.chunks[0].model.embedding.word_embeddings.weight.shape[0] == 504 // 2
    bare = save_checkpoint(root / "bare", 1, tp2, meta={}, save_optimizer=False, save_rng=False)
    full = save_checkpoint(root / "full", 1, tp2, meta={})
    weights = full_state_dict(tp2.chunks[0].model)
    with log.case("meta-says-what-was-saved"):
        for folder, saved in ((bare, False), (full, True)):
            record = read_meta(folder)["checkpoint"]
            assert (record["optimizer"]["saved"], record["rng"]) == (saved, saved), folder
    tp1 = engine(config.replace(make_vocab_size_divisible_by=128), init_mesh(tp=1))
    with log.case("no-optimizer-names-no-load-optim"):
        with pytest.raises(ValueError, match="saved without its optimizer state .* --no-load-optim or --finetune"):
            load_checkpoint(bare, tp1)
    with log.case("no-rng-names-no-load-rng"):
        with pytest.raises(ValueError, match="saved without its RNG states .* --no-load-rng or --finetune"):
            load_checkpoint(bare, tp1, load_optimizer=False)
    with log.case("tp2-padding-loads-at-tp1"):
        load_checkpoint(bare, tp1, load_optimizer=False, load_rng=False)
        model = tp1.chunks[0].model
        assert model.embedding.word_embeddings.weight.shape[0] == 512 and not tp1.optimizer.state
        loaded = full_state_dict(model)
        assert all(torch.equal(loaded[k], v) for k, v in weights.items()) and loaded.keys() == weights.keys()
    with log.case("full-checkpoint-loads-optimizer"):
        load_checkpoint(full, tp1)
        assert len(tp1.optimizer.state) == len(list(tp1.chunks[0].model.parameters()))
    with log.case("memory-estimate-matches-the-engines"):  # what pretrain.py checks before building (fits.py)
        for built, cfg in ((tp2, config), (tp1, config.replace(make_vocab_size_divisible_by=128))):
            _, estimate = estimated_state_bytes(cfg, built.config, built.mesh)
            held = sum(state_bytes(built).values())
            assert abs(estimate - held) <= 0.02 * held, (built.mesh.tp_size, estimate, held)
    with log.case("rng-warning-only-with-dropout"):  # saved at tp 2, loaded at dp 2: RNG states not restored
        said = warnings_of(lambda: load_checkpoint(full, tp1))
        dropout = engine(config.replace(make_vocab_size_divisible_by=128, hidden_dropout=0.1), init_mesh(tp=1))
        said_with_dropout = warnings_of(lambda: load_checkpoint(full, dropout))
        if torch.distributed.get_rank() == 0:  # rank 0 says it
            assert not any("RNG states not restored" in m for m in said), said  # no dropout: nothing differs
            assert any("RNG states not restored (dropout masks will differ" in m for m in said_with_dropout)
    return log


def warnings_of(action) -> list[str]:
    """The warnings tpzoo.checkpoint.load logs while ``action`` runs."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("tpzoo.checkpoint.load")
    logger.addHandler(handler)
    try:
        action()
    finally:
        logger.removeHandler(handler)
    return said


@background.fixture
def outcomes(tmp_path_factory) -> tuple[list[CaseLog], dict]:
    """The ranks' logs, and the pretrain.py runs: a first run with --save DIR --load DIR and the
    --no-save flags, a resume of it without --no-load-optim (refused before anything is built), then
    --finetune from it into another folder (--use-checkpoint-args: accepted, what --load does)."""
    root = tmp_path_factory.mktemp("checkpoint_flags")
    logs = background.spawn(rank_checks, 2, str(root))
    first = run(command([*TINY, "--train-iters", "2", "--save", "run", "--load", "run", "--no-save-optim",
                         "--no-save-rng"]), root)
    resumed = run(command([*TINY, "--train-iters", "4", "--load", "run", "--data-cache-path", "cache"]), root)
    tuned = run(command([*TINY, "--train-iters", "2", "--load", "run", "--finetune", "--use-checkpoint-args",
                         "--save", "tuned"]), root)
    return logs, dict(root=root, first=first, resumed=resumed, tuned=tuned)


@pytest.mark.parametrize("name", RANK_CASES)
def test_checkpoint_save_and_load_options(outcomes, name):
    assert_case(outcomes[0], name)


@pytest.mark.parametrize("name", CLI_CASES)
def test_checkpoint_flags_of_pretrain(outcomes, name):
    runs = outcomes[1]
    root, first, tuned = runs["root"], runs["first"], runs["tuned"]
    assert first.returncode == 0, first.stderr[-2000:]
    if name == "first-run-starts-from-scratch":
        assert "no checkpoint in --load run (also the --save folder): starting from scratch" in first.stdout
    elif name == "no-save-flags-in-meta":
        record = json.loads((root / "run" / "iter_0000002" / "meta.json").read_text())["checkpoint"]
        assert (record["optimizer"]["saved"], record["rng"]) == (False, False)
    elif name == "resume-without-optimizer-exits-early":  # one line, before the data and the model are built
        resumed = runs["resumed"]
        assert resumed.returncode == 2 and resumed.stderr.count("\n") == 1, resumed.stderr[-2000:]
        assert "was saved without its optimizer state (--no-save-optim); load it with --no-load-optim or " \
               "--finetune" in resumed.stderr
        assert resumed.stdout == "" and not (root / "cache").exists(), resumed.stdout[-2000:]  # no data built
    else:  # a checkpoint without optimizer and RNG: --finetune needs neither, and starts at iteration 0
        assert tuned.returncode == 0, tuned.stderr[-2000:]
        assert "finetuning from run/iter_0000002 at iteration 0 (consumed samples 0)" in tuned.stdout
        meta = json.loads((root / "tuned" / "iter_0000002" / "meta.json").read_text())
        assert (meta["iteration"], meta["consumed_samples"], meta["checkpoint"]["optimizer"]["saved"]) == (2, 16, True)
        assert sorted(metrics(root / "tuned")) == [1, 2]
        assert (root / "run" / "latest").read_text().strip() == "iter_0000002"  # the loaded folder untouched
