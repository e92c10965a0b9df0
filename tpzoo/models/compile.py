"""torch.compile of a model's blocks: what ``ParallelPlan(compile=True)`` does to the model built with it.

As torchtitan does, each layer of ``model.layers`` is compiled on its own, and the head (an LM head's
final norm, logits and vocab-parallel cross entropy; BERT's heads): the layers share one code object,
so dynamo traces a layer once and every other layer reuses the graph. The embedding stays eager.
Activation recompute wraps the compiled layers (``StagedModel.run_layers``: compile inside the
checkpoint), so the recompute and its RNG replay run in eager code around compiled ones.

The tp collectives (autograd functions around ``dist.all_reduce`` and friends) trace into the graphs
at any tp. Dropout that draws from the tp stream (``TPRandom``: attention dropout, and residual
dropout on sequence shards) swaps the generator's state, which dynamo cannot trace: those
dropouts run eagerly between compiled graphs, as does a mixture of experts' loop over its experts, which reads
the token counts on the host (``graph_break`` on the module: ``tpzoo.models.moe.Experts``); ``fullgraph`` is off for
such models only, a model without them compiles each block into one graph or fails loudly. Inductor draws dropout masks
with its own generator: with dropout, compiled and eager runs differ in the masks they draw.

Backend: ``TPZOO_COMPILE_BACKEND`` (default "inductor"; "aot_eager" traces and partitions but runs
the aten ops eagerly: the cheap check that a model traces). Mode: ``TPZOO_COMPILE_MODE`` (default
torch's; e.g. "max-autotune"), read when a model is compiled.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from tpzoo.parallel.random import TPRandom

BACKEND_ENV, MODE_ENV = "TPZOO_COMPILE_BACKEND", "TPZOO_COMPILE_MODE"
DEFAULT_BACKEND = "inductor"


def compile_backend() -> str:
    """The torch.compile backend of ``TPZOO_COMPILE_BACKEND`` (default inductor)."""
    return os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND


def compile_problem(device: torch.device) -> str | None:
    """Why the models cannot be compiled for ``device`` here (one sentence naming a fix), or None."""
    backend = compile_backend()
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile is not supported by this Python/torch ({torch.__version__}); drop --compile"
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        return (f"{BACKEND_ENV}={backend} is not a torch.compile backend; use one of inductor, aot_eager, eager "
                f"or unset it")
    if os.environ.get(MODE_ENV) == "reduce-overhead" and device.type != "cuda":
        return f"{MODE_ENV}=reduce-overhead records CUDA graphs and needs a GPU; unset it on the {device.type}"
    if backend == "inductor" and device.type == "cpu" and not shutil.which(os.environ.get("CXX", "g++")):
        return ("inductor on the CPU needs a C++ compiler and none was found (g++, or $CXX); install one, or set "
                f"{BACKEND_ENV}=aot_eager, or drop --compile")
    if backend == "inductor" and device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor on CUDA needs triton for this GPU; pip install triton, or drop --compile"
    return None


def _breaks_graph(model: nn.Module) -> bool:
    """Whether training draws dropout from the tp stream (a ``TPRandom`` whose module drops something) or runs a
    module that says it breaks the graph (``graph_break``: the experts' loop), which dynamo cannot trace whole."""
    return any(isinstance(m, TPRandom) and getattr(m.module, "p", 1.0) > 0 or getattr(m, "graph_break", False)
               for m in model.modules())


def compile_model(model: nn.Module) -> nn.Module:
    """Compile ``model.layers``' layers one by one and ``model.head`` in place (a ``StagedModel``; the
    embedding stays eager); returns the model. Backend and mode: module docstring."""
    options = dict(backend=compile_backend(), fullgraph=not _breaks_graph(model))
    if os.environ.get(MODE_ENV):
        options["mode"] = os.environ[MODE_ENV]
    for layer in model.layers.values():
        layer.compile(**options)
    if model.head is not None:
        model.head.compile(**options)
    return model
