"""The keys of a rank's report and of the metrics derived from it, defined once: name, unit, meaning.

``memory.report_memory()`` and ``memory.capacity_report()`` produce the measured keys;
``attribution`` derives the headroom keys from them over the stages. Every module reads a key
by its name here (``PEAK_RESERVED.key``), never as a string of its own; the memory parts
(parameters, activations, ...) are parts.py's. The README's metric table ("What is logged")
states the same meanings, and tests/test_keys.py holds it to this table. No torch: the offline
commands read it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Key:
    """One key of the report, logged as ``memory/<key>`` (max over stages).

    Args:
        key: its name in the report, the records and the logged metrics.
        unit: "GB" (1e9 bytes), "count" (an int), "%", "stage" or "rank" (an int: where a figure is).
        meaning: what it is, as the README's metric table says it (keys of one row share it).
        stat: the ``torch.cuda.memory_stats()`` statistic it is read from, by default; None: not one.
        logged: whether ``memory/<key>`` is in the logged metrics (a key only headroom reads: not).
    """

    key: str
    unit: str
    meaning: str
    stat: str | None = None
    logged: bool = True


GB, COUNT, PERCENT, STAGE, RANK = "GB", "count", "%", "stage", "rank"

_CUDA_PEAK = (
    "max over stages of the CUDA caching allocator's peak: since the process started, or since the "
    "previous logging step with `memory_peak_window=interval`"
)
_CUDA_NOW = "max over stages, now"
_COUNTERS = "counters (ints), max over stages"
_HOST_RSS = "host resident set size, now and peak (VmHWM; same window as the CUDA peaks), max over stages"
_CAPACITY = "capacity (GPU memory, node RAM)"
_HOST_LIMIT = (
    "the job's memory cgroup limit (SLURM, Kubernetes, containers) and its usage, where a stage runs "
    "under one ([docs/host_memory.md](docs/host_memory.md))"
)
_HEADROOM = (
    "GPU: least free memory over stages (total - device_other - peak reserved: memory outside the "
    "allocator is not free for it), where, and peak reserved as % of total"
)
_HOST_HEADROOM = (
    "host: least distance to the OOM killer over stages (MemAvailable, or under a memory cgroup limit "
    "the smaller of it and limit - usage), where; max RSS share (of the limit where there is one)"
)
_HEADROOM_RANK = (
    "with `memory_reduce_scope=world`: the rank with the least GPU / host headroom (`headroom_stage`, "
    "`host_headroom_stage` name its stage)"
)

# memory.report_memory(): the caching allocator's statistics (DEFAULT_MEMORY_KEYS), in this order.
PEAK_ALLOCATED = Key("peak_allocated_gb", GB, _CUDA_PEAK, "allocated_bytes.all.peak")
PEAK_RESERVED = Key("peak_reserved_gb", GB, _CUDA_PEAK, "reserved_bytes.all.peak")
PEAK_ACTIVE = Key("peak_active_gb", GB, _CUDA_PEAK, "active_bytes.all.peak")
PEAK_INACTIVE = Key("peak_inactive_gb", GB, _CUDA_PEAK, "inactive_split_bytes.all.peak")
CURRENT_ALLOCATED = Key("current_allocated_gb", GB, _CUDA_NOW, "allocated_bytes.all.current")
CURRENT_RESERVED = Key("current_reserved_gb", GB, _CUDA_NOW, "reserved_bytes.all.current")
CURRENT_ACTIVE = Key("current_active_gb", GB, _CUDA_NOW, "active_bytes.all.current")
CURRENT_INACTIVE = Key("current_inactive_gb", GB, _CUDA_NOW, "inactive_split_bytes.all.current")
ALLOC_RETRIES = Key("alloc_retries", COUNT, _COUNTERS, "num_alloc_retries")
NUM_OOMS = Key("num_ooms", COUNT, _COUNTERS, "num_ooms")
ALLOCATION_COUNT = Key("allocation_count", COUNT, _COUNTERS, "allocation.all.allocated")
# memory.report_memory(): the host's and the whole device's, always after the allocator's.
HOST_RSS = Key("host_rss_gb", GB, _HOST_RSS)
PEAK_HOST_RSS = Key("peak_host_rss_gb", GB, _HOST_RSS)
DEVICE_USED = Key(
    "device_used_gb",
    GB,
    "the whole GPU's used memory, now (total - free from `torch.cuda.mem_get_info()`, every process on "
    "it, as `nvidia-smi` shows); max over stages",
)
#: Also the outside part as logged (parts.OUTSIDE_KEYS).
DEVICE_OTHER = Key(
    "device_other_gb",
    GB,
    "the part outside this process's caching allocator, now: `device_used - current reserved` (CUDA "
    "context, NCCL buffers, other libraries, other processes); max over stages",
)
# memory.capacity_report(), in this order.
DEVICE_TOTAL = Key("device_total_gb", GB, _CAPACITY)
HOST_TOTAL = Key("host_total_gb", GB, _CAPACITY)
HOST_AVAILABLE = Key(
    "host_available_gb",
    GB,
    "the kernel's MemAvailable, shared by every rank on the node: the distance to the OOM killer "
    "(logged as its min, `host_headroom_gb`)",
    logged=False,
)
HOST_LIMIT = Key("host_limit_gb", GB, _HOST_LIMIT)
HOST_LIMIT_USED = Key("host_limit_used_gb", GB, _HOST_LIMIT)
# attribution: derived over the stages.
HEADROOM = Key("headroom_gb", GB, _HEADROOM)
HEADROOM_STAGE = Key("headroom_stage", STAGE, _HEADROOM)
PEAK_RESERVED_PCT = Key("peak_reserved_pct", PERCENT, _HEADROOM)
HOST_HEADROOM = Key("host_headroom_gb", GB, _HOST_HEADROOM)
HOST_HEADROOM_STAGE = Key("host_headroom_stage", STAGE, _HOST_HEADROOM)
PEAK_HOST_RSS_PCT = Key("peak_host_rss_pct", PERCENT, _HOST_HEADROOM)
HEADROOM_RANK = Key("headroom_rank", RANK, _HEADROOM_RANK)
HOST_HEADROOM_RANK = Key("host_headroom_rank", RANK, _HEADROOM_RANK)

#: Every key, in the report's order, then the derived ones.
KEYS = (
    PEAK_ALLOCATED,
    PEAK_RESERVED,
    PEAK_ACTIVE,
    PEAK_INACTIVE,
    CURRENT_ALLOCATED,
    CURRENT_RESERVED,
    CURRENT_ACTIVE,
    CURRENT_INACTIVE,
    ALLOC_RETRIES,
    NUM_OOMS,
    ALLOCATION_COUNT,
    HOST_RSS,
    PEAK_HOST_RSS,
    DEVICE_USED,
    DEVICE_OTHER,
    DEVICE_TOTAL,
    HOST_TOTAL,
    HOST_AVAILABLE,
    HOST_LIMIT,
    HOST_LIMIT_USED,
    HEADROOM,
    HEADROOM_STAGE,
    PEAK_RESERVED_PCT,
    HOST_HEADROOM,
    HOST_HEADROOM_STAGE,
    PEAK_HOST_RSS_PCT,
    HEADROOM_RANK,
    HOST_HEADROOM_RANK,
)
#: The allocator's keys by default: torch.cuda.memory_stats() name -> logged name, in order.
ALLOCATOR_KEYS = tuple((k.stat, k.key) for k in KEYS if k.stat is not None)
#: The allocator's counters: ints, not GB.
COUNTER_KEYS = tuple(k.key for k in KEYS if k.stat is not None and k.unit == COUNT)
#: What report_memory() always adds, whatever the memory_keys: the host's, then the whole device's.
HOST_KEYS = (HOST_RSS.key, PEAK_HOST_RSS.key)
DEVICE_KEYS = (DEVICE_USED.key, DEVICE_OTHER.key)
#: What capacity_report() returns, in order: what a rank could use.
CAPACITY_KEYS = tuple(k.key for k in (DEVICE_TOTAL, HOST_TOTAL, HOST_AVAILABLE, HOST_LIMIT, HOST_LIMIT_USED))
