"""nemo_memlog: pipeline-wide memory metrics for Megatron-Core / NeMo training.

The data path, one module each: ``report_memory`` (memory.py) -> ``gather_memory`` /
``reduce_max_memory_across_pp_group`` (reduce.py) -> ``training_log`` (hook.py) ->
writers (writers/). Importing this package imports torch only, no logging backend.
"""

from .memory import DEFAULT_MEMORY_KEYS, report_memory
from .reduce import GatheredMemory, MemoryReduceError, gather_memory, reduce_max_memory_across_pp_group

__all__ = [
    "DEFAULT_MEMORY_KEYS",
    "GatheredMemory",
    "MemoryReduceError",
    "gather_memory",
    "reduce_max_memory_across_pp_group",
    "report_memory",
]
__version__ = "0.1.0"
