"""training_log: the per-iteration hook users call. It finds the monitor (a MemoryMonitor) for its config.

Called on every rank at every iteration. The gate (``log_memory_to_tensorboard`` and
``iteration % tensorboard_log_interval``) depends only on the settings and the iteration,
so every stage decides alike and enters the one collective together. Off the logging
iterations it does one dictionary lookup and the monitor's gate (``MemoryMonitor.logs_at``, through
``log`` and ``before_iteration``, the door every way in uses), and returns None: no collective, no
allocation, no backend call. With a ``model``, the call before a logging iteration also arms the
activation meter (measure/activations.py) for that iteration. The caller's ``metrics`` are logged
only on logging iterations, in the same dict, at the same step.

Which monitor a call belongs to:

- A monitor is found by its settings (``config.Settings``, compared by value) and the
  ``writers`` object given (by identity). A config object rebuilt at every call, with the
  same settings, reuses the monitor: one set of writers (one writer process), one flight record.
- The config object last seen for each monitor is held, so the common case, the same object at
  every call, costs a lookup by that object and no reading of the settings. Its id cannot
  be reused by another object while it is held.
- A config whose settings differ from every open monitor's starts a new monitor, as a new config
  always did. Settings that change at every call would start a monitor (and its writers) at
  every call: past ``MANY_RUNS`` open monitors, training_log warns once per process, saying so.
- The groups (``pg_collection``, ``pp_group``) are read when the monitor is placed, at its
  first logging step; a later call that finds the monitor does not change them. The run
  config the writers record is the first config object's.
- ``close_writers()`` ends every monitor training_log made; the next call starts a new one.
- ``NEMO_MEMLOG_DISABLED=true`` (config/switches.py): no monitor is made; each call returns None
  after one environment look-up (every rank reads the same environment: none enters a collective).

What lives here is per process by nature (a free function has to find its monitor): the open
monitors training_log made, and its one warning.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from ..config import resolve, switched_off
from ..reduce import runs_ended
from ..warn import WarnOnce
from . import MemoryMonitor

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from torch.distributed import ProcessGroup

    from ..writers.base import Writers

#: Open monitors made by training_log past which a new one warns (once per process).
MANY_RUNS = 4


class _Entry:
    """A monitor training_log made: its settings and given writers (what finds it), and the
    config object last seen for it (held: the fast path's key is that object's id)."""

    __slots__ = ("monitor", "writers", "config", "key")

    def __init__(self, monitor: MemoryMonitor, writers, config, key):
        self.monitor, self.writers, self.config, self.key = monitor, writers, config, key


class _OpenMonitors:
    """The monitors training_log made in this process, and its one warning."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []  # oldest first
        self.by_object: dict = {}  # id(config), or (id(config), id(writers)) -> the _Entry last seen with that config
        self.warnings = WarnOnce()


# Per process, not per monitor: training_log is a free function, called with a config, and this is
# how it finds the monitor that config belongs to (close_writers() ends them all).
_open_monitors = _OpenMonitors()


def training_log(
    iteration: int,
    config: Any,
    *,
    pg_collection: Any = None,
    pp_group: ProcessGroup | None = None,
    writers: Writers | None = None,
    metrics: dict | None = None,
    model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
    optimizer: Any = None,
    facts: dict | None = None,
) -> dict | None:
    """Log pipeline-wide memory (and ``metrics``) every ``tensorboard_log_interval`` iterations.

    Call it on every rank at every iteration. Logging iterations are those where
    ``log_memory_to_tensorboard`` is on and ``iteration % tensorboard_log_interval == 0``;
    there every rank of the group enters one gather. Off them the call costs a lookup: no
    collective, no allocation, no backend call. Calls with the same settings (and the same
    ``writers``) share one monitor: one set of writers, one flight record (module docstring).

    Args:
        iteration: the training iteration, an int >= 0, the same on every rank.
        config: a LoggerConfig, any object with its field names (Megatron-Bridge's
            LoggerConfig), or a container whose ``.logger`` is one (its ConfigContainer).
        pg_collection: megatron-core's process groups, for the pipeline group. Read at the
            run's first logging step only.
        pp_group: the pipeline-parallel group, where no ``pg_collection`` is given. Default:
            megatron-core's parallel_state; without one, the whole world.
        writers: where the writer rank (global rank world_size - 1) logs each step; flushed,
            never closed, by us. Default: the backends the settings enable, built once.
        metrics: the caller's own numbers, logged in the same dict at the same step, on
            logging iterations only.
        model: the stage's model (a module, or a list of chunks). Adds what the memory is
            made of (docs/composition.md) and arms the activation meter on the iteration
            before each logging one. Every rank passes it, or none.
        optimizer: the optimizer (torch's, or Megatron's wrappers), for the optimizer state.
        facts: what the loop knows of the run (``micro_batch_size``, ``microbatches`` per
            iteration, ``distributed_optimizer``...), recorded for ``nemo-memlog advise``.

    Returns:
        The unified dict (the README's metric table) on every rank on logging iterations;
        None otherwise, and always with ``NEMO_MEMLOG_DISABLED=true`` (read when a config is
        first seen: nothing is resolved, measured or gathered, on every rank alike).

    Raises:
        TypeError: ``config`` is no config; ``iteration`` is no int (checked when a config
            object is first seen); ``metrics`` is no mapping; ``model`` or ``optimizer``
            cannot be counted; ``facts`` is no mapping or has a name that is no string.
        ValueError: a setting that cannot work (naming the field); a negative ``iteration``;
            a fact that breaks its rule.
        MemoryReduceError: the ranks disagree (keys, iteration, interval), or one did not
            join within ``memory_reduce_timeout_s``. Every rank of the group raises alike.

        A backend that fails (a full disk, a lost W&B connection) warns and never raises here.
    """
    key = id(config) if writers is None else (id(config), id(writers))
    entry = _open_monitors.by_object.get(key)
    if entry is None or entry.config is not config:  # the entry holds its config: an id match is that object
        if switched_off():  # NEMO_MEMLOG_DISABLED, read where a run would start: every rank reads it alike
            return None
        entry = _entry_for(config, writers, key, pg_collection, pp_group, iteration)
    # The run's door, as every way in drives it: the step (the monitor's gate decides), then, when the
    # next iteration logs, its activations are measured.
    monitor = entry.monitor
    logged = monitor.log(iteration, metrics, model=model, optimizer=optimizer, facts=facts)
    if model is not None:
        monitor.before_iteration(iteration + 1, model)
    return logged


def check_iteration(iteration: Any) -> None:
    """Raise TypeError (ValueError) for an ``iteration`` that is no int (is negative): the gate takes
    its modulo at every call, and a string or a float would gate wrongly or fail oddly there."""
    if isinstance(iteration, bool) or not isinstance(iteration, numbers.Integral):
        raise TypeError(
            f"training_log: iteration must be an int (the training iteration); got {type(iteration).__name__}"
        )
    if iteration < 0:
        raise ValueError(f"training_log: iteration must be an int >= 0; got {iteration}")


def _entry_for(config, writers, key, pg_collection, pp_group, iteration) -> _Entry:
    """The open monitor for ``config``'s settings and ``writers``, or a new one; seen with ``config`` from now on."""
    settings = resolve(config)  # raises, naming the field, for a config that cannot work
    check_iteration(iteration)
    entry = _find(settings, writers)
    if entry is None:
        started = len(_open_monitors.entries) + 1
        if started > MANY_RUNS:
            _open_monitors.warnings(
                ("many runs",),
                f"training_log has started {started} runs in this process, one for each config whose "
                f"settings differ from every earlier one's; each run has its own writers (a writer process), "
                f"flight record and gloo group. Build the config once and pass the same settings at every call "
                f"(or call close_writers() when a run ends).",
                stacklevel=3,
                category=RuntimeWarning,  # misuse, at the caller's line
            )
        monitor = MemoryMonitor(
            settings, run_config=config, pg_collection=pg_collection, pp_group=pp_group, writers=writers
        )
        entry = _Entry(monitor, writers, config, key)
        _open_monitors.entries.append(entry)
    else:
        _open_monitors.by_object.pop(entry.key, None)  # one object per monitor: the map stays as small as the monitors
        entry.config, entry.key = config, key
    _open_monitors.by_object[key] = entry
    return entry


def _find(settings, writers) -> _Entry | None:
    matching = (
        entry for entry in _open_monitors.entries if entry.writers is writers and entry.monitor.settings == settings
    )
    return next(matching, None)


def monitor_of(config: Any, *, writers: Writers | None = None) -> MemoryMonitor | None:
    """The open monitor training_log made for ``config``'s settings (and ``writers``), or None.
    Never starts one. Raises as training_log does for a config it cannot read."""
    entry = _find(resolve(config), writers)
    return None if entry is None else entry.monitor


def open_monitors() -> tuple[MemoryMonitor, ...]:
    """The open monitors training_log made, oldest first."""
    return tuple(entry.monitor for entry in _open_monitors.entries)


def close_writers() -> None:
    """End every monitor training_log made on this rank; the next training_log call starts a new one.

    Ends each monitor's flight record ("close"), releases its reduction state (channels and
    gloo group), and drains and closes the writers it built (writers passed to training_log
    are flushed, not closed). Not needed at exit: at interpreter exit and on SIGTERM the
    writers are closed and the records marked anyway.

    Not a collective, but used like one: call it on every rank at the same point of the
    loop, or on none. It communicates nothing itself.

    Raises:
        Nothing itself. MemoryReduceError comes later, from the new monitor's first logging
        step, when the ranks of its group have not all called it as often (after waiting
        up to ``memory_reduce_timeout_s``, naming the ranks that did not).
    """
    entries = list(_open_monitors.entries)
    _open_monitors.entries.clear()
    _open_monitors.by_object.clear()
    for entry in entries:
        entry.monitor.close()
    runs_ended()
