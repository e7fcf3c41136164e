"""Megatron-Bridge integration: ``MemoryLogCallback``, for recipes run with ``pretrain()``.

    from nemo_memlog.bridge import MemoryLogCallback
    pretrain(cfg, forward_step, callbacks=[MemoryLogCallback()])

Thin by design: it translates Bridge's events, step numbers, groups and already-open
loggers into a MemoryMonitor, and nothing in the core imports this module.

- Settings: ``log_memory_to_tensorboard``, ``tensorboard_log_interval`` and
  ``memory_keys`` come from the recipe's own ``cfg.logger`` (so the dotted overrides users
  already pass work); nemo_memlog's own settings are keyword arguments.
- Steps: ``on_train_step_end`` fires before Bridge increments ``train_state.step``, and
  Bridge's ``training_log`` then logs that iteration at ``step + 1``. Memory is gated and
  logged at ``step + 1`` too, so memory and loss share an x-axis.
- Loggers: on the last rank, the monitor writes into the TensorBoard writer, W&B run,
  MLflow run and Comet experiment Bridge opened (``state.*_logger``), on the training
  thread, before Bridge logs the same step; it opens none of its own.
- Once per series: Bridge's own ``training_log`` also writes ``memory/*`` when the flag is
  set (before 0.5, the last stage's values only). The callback takes that over: from
  ``on_train_start`` to ``on_train_end`` it holds ``cfg.logger.log_memory_to_tensorboard``
  False on every rank (Bridge reads the flag for nothing else) and writes every series
  itself, pipeline-wide.
- Flight records: every rank records its memory for ``nemo-memlog postmortem``, by default in
  ``memory_records`` beside the recipe's ``logger.tensorboard_dir`` (else its
  ``wandb_save_dir``, else the working directory); ``memory_record_dir=`` picks another
  folder, ``memory_record_dir="off"`` none. ``on_train_end`` marks the record ended.
"""

from __future__ import annotations

import dataclasses

from megatron.bridge.training.callbacks import Callback

from .config import LoggerConfig, checked_settings, memory_record_dir
from .monitor import MemoryMonitor

#: Our settings that Bridge's LoggerConfig lacks: the callback's keyword arguments.
BRIDGE_FIELDS = ("log_memory_to_tensorboard", "tensorboard_log_interval", "memory_keys")
OWN_SETTINGS = tuple(f.name for f in dataclasses.fields(LoggerConfig)
                     if f.name.startswith("memory_") and f.name not in BRIDGE_FIELDS)


class MemoryLogCallback(Callback):
    """Pipeline-wide memory in the recipe's own dashboards. Register it on every rank."""

    def __init__(self, **settings):
        self.settings = checked_settings(
            "MemoryLogCallback", settings, OWN_SETTINGS,
            " (log_memory_to_tensorboard, tensorboard_log_interval and memory_keys come from the recipe's cfg.logger)")
        self.monitor: MemoryMonitor | None = None
        self._bridge_logger = None

    def on_train_start(self, context) -> None:
        bridge_logger = context.state.cfg.logger
        if not bridge_logger.log_memory_to_tensorboard:
            return
        # The flight records' default folder is beside the recipe's own logs (its tensorboard_dir).
        settings = {**self.settings,
                    "memory_record_dir": self.settings.get("memory_record_dir") or memory_record_dir(bridge_logger)}
        config = LoggerConfig(
            log_memory_to_tensorboard=True,
            tensorboard_log_interval=bridge_logger.tensorboard_log_interval,
            memory_keys=bridge_memory_keys(getattr(bridge_logger, "memory_keys", None)),
            **settings,
        )
        monitor = MemoryMonitor(config, pg_collection=_pg_collection(context.model))
        monitor.place()
        if monitor.is_writer_rank:
            # Open (or find) Bridge's loggers while the flag still reads true, so the
            # config they record shows the user's setting.
            monitor.use_writers(_adopt_open_loggers(context.state))
        bridge_logger.log_memory_to_tensorboard = False
        self.monitor, self._bridge_logger = monitor, bridge_logger

    def on_train_step_end(self, context) -> None:
        monitor = self.monitor
        if monitor is not None:
            monitor.log(context.state.train_state.step + 1)

    def on_train_end(self, context) -> None:
        if self.monitor is None:
            return
        self._bridge_logger.log_memory_to_tensorboard = True
        self.monitor.close()  # ends the flight record; Bridge's own loggers are flushed, not closed
        self.monitor = self._bridge_logger = None


def bridge_memory_keys(memory_keys: dict | None) -> dict | None:
    """The recipe's ``memory_keys``, named as Bridge names them: ``bytes`` -> ``gigabytes``
    in the logged names of byte statistics, as Bridge's ``report_memory`` renames them
    (values are GB in both), so a recipe's own series keep their names. None (the recipe
    sets none): our DEFAULT_MEMORY_KEYS names (``peak_reserved_gb``...), which headroom and
    the per-stage defaults key on; README maps Bridge's default names to them."""
    if not memory_keys:
        return None
    return {stat: name.replace("bytes", "gigabytes") if "bytes" in stat else name
            for stat, name in memory_keys.items()}


def _pg_collection(model):
    """Bridge's process groups for ``model`` (megatron-core's parallel_state without one)."""
    try:
        from megatron.bridge.training.utils.pg_utils import get_pg_collection
    except ImportError:
        return None
    return get_pg_collection(model) if model else None


def _adopt_open_loggers(state):
    """Writers over every logger Bridge opened: each ``*_logger`` property of its state
    (opened on first access, on the last rank only), whatever backends this Bridge has."""
    from .writers import adopt_writers

    names = sorted(name for name in dir(type(state)) if name.endswith("_logger")
                   and isinstance(getattr(type(state), name), property))
    return adopt_writers(getattr(state, name) for name in names)

