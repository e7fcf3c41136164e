"""nemo_memlog: pipeline-wide memory metrics for Megatron-Core / NeMo training.

The data path, one module each: ``report_memory`` (memory.py) -> ``gather_memory`` /
``reduce_max_memory_across_pp_group`` (reduce/) -> ``training_log`` (hook.py) ->
writers (writers/). Exports load on first use, so ``import nemo_memlog`` imports no
logging backend, and the report command (cli.py) runs without torch.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker and an IDE see: the real signatures (loaded lazily below)
    from .attribution import GatheredMemory
    from .config import LoggerConfig, from_overrides
    from .failure.recorder import FlightRecorder
    from .hook import close_writers, training_log
    from .measure.composition import report_model_state
    from .measure.phase import memory_phase
    from .memory import DEFAULT_MEMORY_KEYS, capacity_report, report_memory, reset_peaks
    from .monitor import MemoryMonitor
    from .reduce import MemoryReduceError, gather_memory, reduce_max_memory_across_pp_group
    from .writers import build_writers

_EXPORTS = {
    "LoggerConfig": "config",
    "from_overrides": "config",
    "training_log": "hook",
    "close_writers": "hook",
    "DEFAULT_MEMORY_KEYS": "memory",
    "report_memory": "memory",
    "capacity_report": "memory",
    "MemoryMonitor": "monitor",
    "reset_peaks": "memory",
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
__version__ = "0.7.0"


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_memlog' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return __all__
