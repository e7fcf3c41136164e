"""nemo_memlog: pipeline-wide memory metrics for Megatron-Core / NeMo training.

The data path, one module each: ``report_memory`` (memory.py) -> ``gather_memory`` /
``reduce_max_memory_across_pp_group`` (reduce.py) -> ``training_log`` (hook.py) ->
writers (writers/). Importing this package imports torch only, no logging backend.
"""

from .config import LoggerConfig, from_overrides
from .hook import close_writers, training_log
from .memory import DEFAULT_MEMORY_KEYS, report_memory
from .reduce import GatheredMemory, MemoryReduceError, gather_memory, reduce_max_memory_across_pp_group
from .writers import build_writers

__all__ = [
    "DEFAULT_MEMORY_KEYS",
    "LoggerConfig",
    "build_writers",
    "close_writers",
    "from_overrides",
    "training_log",
    "GatheredMemory",
    "MemoryReduceError",
    "gather_memory",
    "reduce_max_memory_across_pp_group",
    "report_memory",
]
__version__ = "0.1.0"
