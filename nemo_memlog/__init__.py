"""nemo_memlog: pipeline-wide memory metrics for Megatron-Core / NeMo training.

The data path, one module each: ``report_memory`` (memory.py) -> ``gather_memory`` /
``reduce_max_memory_across_pp_group`` (reduce.py) -> ``training_log`` (hook.py) ->
writers (writers/). Exports load on first use, so ``import nemo_memlog`` imports no
logging backend, and the report command (cli.py) runs without torch.
"""

import importlib

_EXPORTS = {
    "LoggerConfig": "config",
    "from_overrides": "config",
    "training_log": "hook",
    "close_writers": "hook",
    "DEFAULT_MEMORY_KEYS": "memory",
    "report_memory": "memory",
    "reset_peaks": "memory",
    "memory_phase": "phase",
    "report_model_state": "composition",
    "GatheredMemory": "reduce",
    "MemoryReduceError": "reduce",
    "gather_memory": "reduce",
    "reduce_max_memory_across_pp_group": "reduce",
    "build_writers": "writers",
    "FlightRecorder": "failure.recorder",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.2.0"


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_memlog' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return __all__
