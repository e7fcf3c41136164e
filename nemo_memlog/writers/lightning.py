"""Lightning loggers: anything implementing Lightning's ``Logger`` (TensorBoard, CSV, W&B,
MLflow, Comet, a user's own), from ``lightning.pytorch`` or ``pytorch_lightning``.

Adopted only, never opened from a config (in base.ADOPTABLE, not CONFIGURED): the ``Trainer``
owns its loggers, and ``nemo_memlog.lightning.MemoryLogCallback`` hands them over on global
rank 0, where their ``log_metrics`` writes (it is rank-zero-only: elsewhere it does nothing).
Each step goes through the logger's own ``log_metrics(metrics, step)`` and then ``save()``, as
Lightning's logger connector writes its own metrics, so each logger stores it its own way and
with its own names (MLFlowLogger keeps ``/``; WandbLogger adds ``trainer/global_step``).
"""

from __future__ import annotations

from typing import Any

#: Where Lightning's ``Logger`` base class lives, in either package.
_LOGGER_MODULES = ("lightning.pytorch.loggers", "pytorch_lightning.loggers")


def adopt(obj: object) -> LightningLoggerBackend | None:
    """A Lightning ``Logger`` (any subclass, either package) that a Trainer holds, else None.
    Recognised by its base classes' modules, without importing Lightning."""
    for cls in type(obj).__mro__:
        if cls.__name__ == "Logger" and cls.__module__.startswith(_LOGGER_MODULES):
            return LightningLoggerBackend(obj)
    return None


class LightningLoggerBackend:
    def __init__(self, logger: Any):
        self.logger = logger

    def log(self, metrics: dict, step: int) -> None:
        """``metrics`` at ``step``, through the logger's own API. Each logger gets its own copy
        (some rename or pop keys in place)."""
        self.logger.log_metrics(dict(metrics), step=step)
        self.logger.save()

    def flush(self) -> None:
        self.logger.save()

    def close(self, deadline: float | None = None) -> None:
        self.logger.save()  # the Trainer finalizes its loggers
