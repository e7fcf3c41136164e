"""training_log: the per-iteration hook users call. It finds the run's MemoryMonitor.

Called on every rank at every iteration. The gate (``log_memory_to_tensorboard`` and
``iteration % tensorboard_log_interval``) depends only on the config and the iteration,
so every stage decides alike and enters the one collective together. Off the logging
iterations it does one dictionary lookup and the monitor's two attribute reads, and
returns None: no collective, no allocation, no backend call. The caller's ``metrics`` are
logged only on logging iterations, in the same dict, at the same step.
"""

from __future__ import annotations

from .monitor import MemoryMonitor

# One monitor per config object (and writers object, when given). The monitor holds both,
# so an id is never reused while it is cached.
_monitors: dict = {}


def training_log(iteration: int, config, *, pg_collection=None, pp_group=None, writers=None,
                 metrics: dict | None = None) -> dict | None:
    """Log pipeline-wide memory (and ``metrics``) every ``tensorboard_log_interval`` iterations.

    ``config`` is a LoggerConfig, any object with its field names, or a container with
    ``.logger`` (Megatron-Bridge's ConfigContainer); its settings are read once, at the
    first call. Returns the unified dict on every rank on logging iterations, None
    otherwise. Only the writer rank (global rank world_size - 1) hands it to ``writers``
    (default: the fan-out built once from ``config``). See README for the keys.
    """
    key = id(config) if writers is None else (id(config), id(writers))
    monitor = _monitors.get(key)
    if monitor is None:
        monitor = _monitors[key] = MemoryMonitor(config, pg_collection=pg_collection, pp_group=pp_group,
                                                 writers=writers)
    if not monitor.enabled or iteration % monitor.interval:  # monitor.log's gate, one call fewer
        return None
    return monitor.log_step(iteration, metrics)


def close_writers() -> None:
    """Drain and close the writers training_log built, and end each run's flight record with
    "close" (at exit and on SIGTERM the writers are closed, and the records marked, anyway)."""
    for monitor in list(_monitors.values()):
        monitor.close()
    _monitors.clear()
