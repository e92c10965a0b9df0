"""Training machinery over the mesh: pipeline schedules, data parallelism and ZeRO-1, gradient norms and
clipping, loss scaling, and ``Engine``, one optimizer step over a global batch.

Names load on first use, so ``tpzoo.engine.config`` imports without torch."""

from tpzoo.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {"config": ("EngineConfig",), "train_step": ("Engine", "StepResult")})
