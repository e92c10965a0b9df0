"""The lines rank 0 prints when a run starts, before its first step: what is trained, where, in how much memory
and on what data (fine-tuning: the first three, then its own data line).

    model     gpt, 124.44M parameters (12 layers, hidden 768, 12 heads), float32
    mesh      tp 2 x pp 2 x dp 2 = 8 ranks, sequence parallel, 1f1b schedule, distributed optimizer
    memory    about 357 MiB per rank: weights 119 MiB, gradients 119 MiB, main weights 0 KiB, optimizer state
              119 MiB (rank 0's shards; activations not counted)
    data      demo corpus data/demo (tokenizer: 512 tokens), 96,304 train samples of 64 tokens, 1,906 validation;
              the run reads 9,600 (300 iterations)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tpzoo.models.sharding import TIED_COPY, expert_names, full_shape, tp_partitions
from tpzoo.parallel.fsdp import local

if TYPE_CHECKING:
    from tpzoo.engine import Engine
    from tpzoo.models.config import ModelConfig
    from tpzoo.training.setup import Run



def _size(n: float) -> str:
    for unit, scale in (("GiB", 2.0**30), ("MiB", 2.0**20)):
        if n >= scale / 10:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 2**10:.3g} KiB"


def state_bytes(engine: Engine) -> dict[str, int]:
    """This rank's bytes of weights, gradients (as many as the weights), float32 main weights kept apart from the
    weights (bf16, fp16), and optimizer state (AdamW's two float32 moments, SGD's momentum, of the main weights
    this rank steps; allocated at the first step), from its local shards."""
    weights = sum(local(p).numel() * local(p).element_size() for p in engine.params)
    model = {id(p) for p in engine.params}
    owned = [local(p) for p in engine.main.owned]
    main = sum(p.numel() * p.element_size() for p, q in zip(owned, engine.main.owned) if id(q) not in model)
    moments = 2 if engine.config.optimizer == "adam" else int(engine.config.sgd_momentum > 0)
    return dict(weights=weights, gradients=weights, main_weights=main,
                optimizer_state=moments * 4 * sum(p.numel() for p in owned))


def parameter_count(engine: Engine) -> int:
    """The parameters of the model ``engine`` built, as Hugging Face counts them: full (unsharded) tensors of the real
    vocabulary (no padding rows), a tied weight once (a last stage's copy of the word embedding left out), summed
    over the pipeline stages (collective over pp: every rank calls it). The model itself, not its family's count of
    a default one: a BERT without its binary head, a classifier, LoRA adapters are counted as built."""
    mesh, n = engine.mesh, 0
    for chunk in engine.chunks:
        partitions, experts = tp_partitions(chunk.model, mesh.tp_size), expert_names(chunk.model)
        n += sum(math.prod(full_shape(p.shape, partitions.get(name), mesh.ep_size if name in experts else 1))
                 for name, p in chunk.model.named_parameters() if name != TIED_COPY)  # a DTensor's: its global shape
    if mesh.pp_size > 1:
        total = torch.tensor(n, dtype=torch.int64, device=mesh.device)
        dist.all_reduce(total, group=mesh.pp_group)
        n = int(total)
    return n


def setup_lines(config: ModelConfig, engine: Engine) -> list[str]:
    """The model, mesh and memory lines (module docstring) of a model ``config`` built into ``engine`` (collective
    over pp: ``parameter_count``)."""
    mesh, cfg, plan, ft = engine.mesh, engine.config, engine.plan, engine.replicas
    world = mesh.tp_size * mesh.pp_size * mesh.dp_size * mesh.cp_size
    cp = f" x cp {mesh.cp_size} ({plan.cp_comm_type})" if mesh.cp_size > 1 else ""
    options = [o for o, on in (("sequence parallel", plan.sequence_parallel),
                               ("distributed optimizer", cfg.use_distributed_optimizer),
                               (f"HSDP ({mesh.dp_replicate_size} replicas)" if mesh.replicas else "FSDP", plan.fsdp),
                               (f"local SGD (H {cfg.local_sgd_steps})", cfg.local_sgd_steps),
                               (f"replica group {ft.index} of {ft.count} (per-step fault tolerance)" if ft else "",
                                ft)) if on]
    memory = state_bytes(engine)
    parts = ", ".join(f"{name.replace('_', ' ')} {_size(size)}" for name, size in memory.items())
    return [
        f"model     {config.model_type}, {parameter_count(engine) / 1e6:.2f}M parameters ({config.num_layers} layers, "
        f"hidden {config.hidden_size}, {config.num_attention_heads} heads), {cfg.precision}",
        f"mesh      tp {mesh.tp_size} x pp {mesh.pp_size} x dp {mesh.dp_size}{cp} = {world} ranks, "
        + ", ".join([*options, f"{cfg.schedule} schedule"]),
        f"memory    about {_size(sum(memory.values()))} per rank: {parts} (rank 0's shards; activations not counted)",
    ]


def summary_lines(run: Run) -> list[str]:
    """A pretraining run's start-of-run lines (module docstring)."""
    length = f"{run.train_iters} iterations" + (f", from {run.iteration}" if run.iteration else "")
    valid = f", {len(run.valid):,} validation" if run.valid is not None else ""
    train = f"{len(run.train):,} train samples" if run.train is not None else "no train samples read"
    return setup_lines(run.config, run.engine) + [
        f"data      {run.data_prefix} (tokenizer: {run.tokenizer.vocab_size} tokens), {train} of "
        f"{run.job.model.seq_length} tokens{valid}; the run reads {run.batches.consumed_after(run.train_iters):,} "
        f"({length})",
    ]
