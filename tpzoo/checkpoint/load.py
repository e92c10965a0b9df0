"""``load_checkpoint``: resume an engine from a checkpoint written on any mesh (DCP reshards)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tpzoo.checkpoint.model import check_model_matches
from tpzoo.checkpoint.optimizer import install_states, optimizer_targets, restore_param_groups
from tpzoo.checkpoint.paths import read_meta, resolve_checkpoint
from tpzoo.checkpoint.reader import load_tensors, read_dcp_metadata
from tpzoo.checkpoint.rng import restore_rng, rng_targets
from tpzoo.checkpoint.save import mesh_shape
from tpzoo.checkpoint.tensors import check_finite, finish_load, load_targets, model_entries, split_by_fit
from tpzoo.engine.train_step import Engine
from tpzoo.parallel.health import peers_named

logger = logging.getLogger(__name__)


def load_checkpoint(path: str | Path, engine: Engine, *, load_optimizer: bool = True, load_rng: bool = True
                    ) -> dict[str, Any]:
    """Restore ``engine`` from the checkpoint at ``path`` (a save dir, following ``latest``, or an iter
    folder) and return its meta (the caller's meta, "iteration" and "checkpoint").

    Collective. Any saved tp/pp/dp, ZeRO and precision setting loads onto any current one. Restores the
    model (the saved float32 weights into the main weights, ``MainParams``, and from them the model's),
    with ``load_optimizer`` the optimizer state, its hyperparameters and the loss scaler, and the RNG
    states when the saved mesh shape equals the current one (otherwise they stay as they are, and a
    warning says so where the model has dropout: per-rank streams have no counterpart on another layout) unless ``load_rng`` is
    False. ValueError when the checkpoint's model differs from the engine's (naming the fields), when
    ``path`` holds no checkpoint, or when it was saved without the optimizer state or RNG states that
    ``load_optimizer`` / ``load_rng`` ask for (naming Megatron-LM's flag that skips them), and when a loaded
    tensor holds NaN or inf (``check_finite``).
    """
    with peers_named(f"loading {path}", engine.mesh, engine.config.timeout_s):  # a stuck or dead peer is named
        return _load(path, engine, load_optimizer, load_rng)


def _load(path: str | Path, engine: Engine, load_optimizer: bool, load_rng: bool) -> dict[str, Any]:
    start = time.perf_counter()
    folder = resolve_checkpoint(path, collective=True)
    meta = read_meta(folder)
    record = meta["checkpoint"]
    check_model_matches(record["model"], engine.chunks[0].model, folder)
    check_saved_parts(folder, record, load_optimizer=load_optimizer, load_rng=load_rng)
    saved = read_dcp_metadata(folder).state_dict_metadata
    mesh = engine.mesh
    entries, missing = split_by_fit([e for c in engine.chunks for e in model_entries(
        c.model, mesh, loading=True, weights=engine.main.weights(c.model, loading=True))], saved)
    if missing:
        raise ValueError(f"checkpoint {folder} lacks {len(missing)} parameters of the engine's model "
                         f"({', '.join(e.key for e in missing[:5])}); it is incomplete or of another model")
    states: dict = {}
    if load_optimizer:
        optim_entries, states = optimizer_targets(engine, saved)
        entries += optim_entries
    same_mesh = record["mesh"] == mesh_shape(engine)
    rng = rng_targets(saved) if same_mesh and load_rng else {}
    targets = load_targets(entries, mesh)
    load_tensors({**targets, **rng}, folder)
    finish_load(entries, targets, mesh)
    check_finite(entries, folder, mesh)
    engine.main.publish()
    install_states(engine, states)
    if load_optimizer:
        restore_param_groups(engine.optimizer, record["optimizer"]["param_groups"])
        if engine.scaler is not None and record["loss_scaler"] is not None:
            engine.scaler.resume(record["loss_scaler"])  # the schedule goes on; its settings are the flags'
    restore_rng(mesh, rng)
    config = engine.chunks[0].model.config
    dropout = config.hidden_dropout > 0 or config.attention_dropout > 0  # the only use of the RNG in training
    if dist.get_rank() == 0:
        if not same_mesh and load_rng and dropout:
            logger.warning("checkpoint %s was saved on mesh %s, this one is %s: RNG states not restored (dropout "
                           "masks will differ from an uninterrupted run)", folder, record["mesh"], mesh_shape(engine))
        logger.info("loaded checkpoint %s (iteration %d) in %.2fs", folder, meta["iteration"],
                    time.perf_counter() - start)
    return meta


def check_saved_parts(folder: Path, record: dict[str, Any], *, load_optimizer: bool, load_rng: bool) -> None:
    """ValueError when the checkpoint (``record``: its meta's "checkpoint") lacks what is to be loaded
    (checkpoints from before the save options hold both); pretrain.py checks it before building anything."""
    checks = ((load_optimizer, record["optimizer"].get("saved", True), "optimizer state", "optim"),
              (load_rng, record.get("rng", True), "RNG states", "rng"))
    for wanted, saved, what, flag in checks:
        if wanted and not saved:
            raise ValueError(f"checkpoint {folder} was saved without its {what} (--no-save-{flag}); load it with "
                             f"--no-load-{flag} or --finetune")
