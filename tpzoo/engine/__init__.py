"""Training machinery over the mesh: pipeline schedules, data parallelism and ZeRO-1, gradient norms and
clipping, loss scaling, and ``Engine``, one optimizer step over a global batch."""

from tpzoo.engine.config import EngineConfig
from tpzoo.engine.train_step import Engine, StepResult

__all__ = ["Engine", "EngineConfig", "StepResult"]
