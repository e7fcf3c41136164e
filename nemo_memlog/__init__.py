"""nemo_memlog: pipeline-wide memory metrics for Megatron-Core / NeMo training.

The data path, one module each: ``report_memory`` (rank/memory.py) -> ``gather_memory`` /
``reduce_max_memory_across_pp_group`` (reduce/) -> ``training_log`` (monitor/training_log.py) ->
writers (writers/). Exports load on first use, so ``import nemo_memlog`` imports no
logging backend, and the report command (cli.py) runs without torch.

The modules, by layer, bottom to top (docs/architecture.md says more of each):

- ``process_wide``: what belongs to the process (signal handlers, exit and at-fork callbacks; the OOM observer);
- ``parts``: the memory parts, defined once; ``keys``: the report's keys, defined once;
- ``units``: the units rule; ``bounded``: size-capped file reads;
- ``redaction``: secrets found and scrubbed; ``commands``: commands as printed, the exit statuses;
- ``warn``: the warn-once helper and the notices on the "nemo_memlog" logger;
- ``config/``: one frozen ``Settings`` from any config;
- ``rank/``: what one rank reads of itself (``memory``: its numbers; ``host_limit``: the memory cgroup's
  limit; ``megatron``: the job's shape, megatron-core's groups, this rank's place);
- ``measure/``: the measurement add-ons; ``failure/``: the flight recorder and its file format;
- ``payload``: the collective's wire format; ``attribution``: the gathered values as data;
- ``metrics``: the caller's metrics cleaned and merged; ``reduce/``: every collective;
- ``writers/``: the backends and the fan-out;
- ``advice/``: what a change would do to each stage (pure arithmetic);
- ``offline/``: the commands that read a run's files (report, postmortem, advise; no torch);
- ``monitor/``: the run, its life and step (``placement``: this rank's group and place in the job;
  ``training_log``: the per-iteration call, which finds its run by config);
- ``launch/``: the commands that start the user's job (run, fit; no torch);
- ``integrations/``: Megatron-LM, Megatron-Bridge, Lightning, and ``run``'s import hook;
- ``megatron_lm``, ``bridge``, ``lightning``: the documented names of the integrations;
- ``cli``: the ``nemo-memlog`` command line and its argument types;
- ``testing/``: what tests and scripts share (nothing in the package imports it).
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker and an IDE see: the real signatures (loaded lazily below)
    from .attribution import GatheredMemory
    from .config import LoggerConfig, from_overrides
    from .failure.recorder import FlightRecorder
    from .measure.composition import report_model_state
    from .measure.phase import memory_phase
    from .monitor import MemoryMonitor
    from .monitor.training_log import close_writers, training_log
    from .rank.memory import DEFAULT_MEMORY_KEYS, capacity_report, report_memory, reset_peaks
    from .reduce import MemoryReduceError, gather_memory, reduce_max_memory_across_pp_group
    from .writers import build_writers

_EXPORTS = {
    "LoggerConfig": "config",
    "from_overrides": "config",
    "training_log": "monitor.training_log",
    "close_writers": "monitor.training_log",
    "DEFAULT_MEMORY_KEYS": "rank.memory",
    "report_memory": "rank.memory",
    "capacity_report": "rank.memory",
    "MemoryMonitor": "monitor",
    "reset_peaks": "rank.memory",
    "memory_phase": "measure.phase",
    "report_model_state": "measure.composition",
    "GatheredMemory": "attribution",
    "MemoryReduceError": "reduce",
    "gather_memory": "reduce",
    "reduce_max_memory_across_pp_group": "reduce",
    "build_writers": "writers",
    "FlightRecorder": "failure.recorder",
}

__all__ = [  # written out, so a linter and a type checker read it (a test keeps it equal to _EXPORTS)
    "DEFAULT_MEMORY_KEYS",
    "FlightRecorder",
    "GatheredMemory",
    "LoggerConfig",
    "MemoryMonitor",
    "MemoryReduceError",
    "build_writers",
    "capacity_report",
    "close_writers",
    "from_overrides",
    "gather_memory",
    "memory_phase",
    "reduce_max_memory_across_pp_group",
    "report_memory",
    "report_model_state",
    "reset_peaks",
    "training_log",
]
__version__ = "0.7.2"


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_memlog' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return __all__
