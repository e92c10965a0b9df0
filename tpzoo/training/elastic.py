"""Elastic launches (``--elastic``, under torchrun's ``--nnodes MIN:MAX --max-restarts N``; docs/elastic.md): each
launch takes the mesh its world size W allows. tp, pp and cp are kept; dp is the largest d <= W / (tp x pp x cp)
that ep and HSDP's replica count divide and whose micro-batches divide the global batch G (G % (micro batch x d)
== 0), so the run's math is the same at every size: G stays G, taken in more micro-batches per rank when d is
smaller. The first tp x pp x cp x d ranks form the mesh; the others idle: each says so in one line and exits 0 at
once (torchrun's agent waits for the working ones). A launch that follows a lost or added machine resumes from the
newest intact checkpoint of ``--load`` at the new mesh (checkpoints load at any mesh), and says which mesh it left
and which it took (``mesh_change``). Imports without torch.

    world = place(job.parallel, job.training.global_batch_size, job.training.micro_batch_size)  # on a spare rank: exits
"""

from __future__ import annotations

import math
import os
import sys
from typing import Mapping

from tpzoo.training.parallel_config import ParallelConfig


def elastic_dp(world: int, parallel: ParallelConfig, global_batch: int, micro_batch: int) -> int:
    """The data-parallel size of an elastic launch of ``world`` ranks (module docstring); ValueError naming the sizes
    when not even d = 1 fits."""
    per = parallel.tp * parallel.pp * parallel.cp
    for dp in range(world // per, 0, -1):
        if dp % (parallel.ep * parallel.num_distributed_optimizer_instances) == 0 and \
                global_batch % (micro_batch * dp) == 0:
            return dp
    raise ValueError(f"--elastic: {world} ranks cannot hold one model replica of tp x pp x cp = {per} ranks "
                     f"(--expert-model-parallel-size {parallel.ep}, global batch {global_batch}, micro batch "
                     f"{micro_batch}); launch at least {per * parallel.ep} ranks (torchrun --nnodes MIN:MAX with a "
                     f"larger MIN)")


def place(parallel: ParallelConfig, global_batch: int, micro_batch: int) -> int:
    """This launch's world for an ``--elastic`` run: the ranks its mesh uses (``elastic_dp``), set as WORLD_SIZE
    before the process group starts. Rank 0 names the ranks left idle; a spare rank says it idles and exits 0."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    dp = elastic_dp(world, parallel, global_batch, micro_batch)
    used = dp * parallel.tp * parallel.pp * parallel.cp
    if used < world and rank == 0:
        spare = f"rank {used}" if used == world - 1 else f"ranks {used}-{world - 1}"
        print(f"--elastic: {world} ranks: the mesh tp {parallel.tp} x pp {parallel.pp} x dp {dp} uses ranks 0-"
              f"{used - 1}, {spare} idle (no larger dp fits {world} ranks with global batch {global_batch} and "
              f"micro batch {micro_batch})", flush=True)
    if rank >= used:
        print(f"--elastic: rank {rank} idles (the mesh uses {used} of {world} ranks)", file=sys.stderr, flush=True)
        raise SystemExit(0)
    os.environ["WORLD_SIZE"] = str(used)
    return used


def _shown(mesh: Mapping[str, int]) -> str:
    """``pp 1 x dp 2 x tp 2 (4 ranks)`` (cp when above 1; ep is carved out of dp: no ranks of its own)."""
    axes = [name for name in ("pp", "dp", "cp", "tp") if name != "cp" or mesh.get("cp", 1) > 1]
    ranks = math.prod(mesh.get(name, 1) for name in axes)
    return f"{' x '.join(f'{name} {mesh.get(name, 1)}' for name in axes)} ({ranks} ranks)"


def mesh_change(saved: Mapping[str, int], now: Mapping[str, int], iteration: int) -> str | None:
    """The line that says a resume changed the mesh (``saved``: the checkpoint's ``mesh`` record, ``now``: this
    run's, ``tpzoo.checkpoint.save.mesh_shape``), or None when it did not."""
    if dict(saved) == dict(now):
        return None
    return f"re-meshed: iteration {iteration} was saved on {_shown(saved)}, the run goes on on {_shown(now)}"
