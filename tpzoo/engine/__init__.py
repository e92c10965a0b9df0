"""Training machinery over the mesh: pipeline schedules, data parallelism and ZeRO-1, gradient norms and
clipping, loss scaling, and ``Engine``, one optimizer step over a global batch.

Names load on first use, so ``tpzoo.engine.config`` imports without torch."""

from importlib import import_module
from typing import Any

_MODULE_OF = {"EngineConfig": "config", "Engine": "train_step", "StepResult": "train_step"}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'tpzoo.engine' has no attribute {name!r}")
    return getattr(import_module(f"tpzoo.engine.{_MODULE_OF[name]}"), name)
