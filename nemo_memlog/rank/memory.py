"""One rank's memory numbers: CUDA caching-allocator statistics and host memory.

Nothing here talks to other ranks. `report_memory()` returns the same keys in the
same order on every rank for a given configuration, so that the reduction can line
ranks up without sending names.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from functools import cache, lru_cache
from types import MappingProxyType
from typing import Any

import torch

from .. import process_wide
from ..keys import (
    ALLOCATOR_KEYS,
    DEVICE_KEYS,
    DEVICE_OTHER,
    DEVICE_TOTAL,
    DEVICE_USED,
    HOST_AVAILABLE,
    HOST_KEYS,
    HOST_LIMIT,
    HOST_LIMIT_USED,
    HOST_RSS,
    HOST_TOTAL,
    PEAK_HOST_RSS,
)
from ..process_wide import proc_field, proc_fields
from ..warn import WarnOnce, misuse
from .host_limit import limit_of_process

GB = 1e9

#: torch.cuda.memory_stats() name -> logged name. Same shape as Megatron-Bridge's
#: ``logger.memory_keys``, so a recipe's existing mapping can be passed unchanged. Read-only (a
#: change here would be silently ignored: it is resolved once): extend it in a mapping of your
#: own, ``memory_keys={**DEFAULT_MEMORY_KEYS, "num_device_alloc": "device_allocs"}``.
DEFAULT_MEMORY_KEYS: Mapping[str, str] = MappingProxyType(dict(ALLOCATOR_KEYS))

#: A value a rank reports for a statistic it does not have. The reduction ignores it,
#: and drops the key only when every rank lacks it.
MISSING = math.nan

# The statistic names torch's caching allocator can produce (see torch.cuda.memory_stats).
_TORCH_STAT = re.compile(
    r"^(?:(?:allocation|segment|active|inactive_split|oversize_allocations|oversize_segments"
    r"|allocated_bytes|reserved_bytes|active_bytes|inactive_split_bytes|requested_bytes)"
    r"(?:\.(?:all|small_pool|large_pool))?\.(?:current|peak|allocated|freed)"
    r"|num_alloc_retries|num_ooms|num_sync_all_streams|num_device_alloc|num_device_free"
    r"|max_split_size)$"
)


def report_memory(memory_keys: dict[str, str] | None = None) -> dict[str, int | float]:
    """Return this process's memory statistics as ``{logged_name: value}``.

    Every rank returns the same keys in the same order for the same ``memory_keys``. No
    collective, no allocation on the device, no wait for queued GPU work, and never a new
    CUDA context.

    - CUDA statistics (once this process has initialised CUDA), from
      ``torch.cuda.memory_stats()``: byte counts as GB floats (1e9 bytes), counters as
      Python ints.
    - ``host_rss_gb`` and ``peak_host_rss_gb``: always.
    - ``device_used_gb`` (total - free of the whole device, every process) and
      ``device_other_gb`` (device used - this process's reserved memory: the CUDA
      context, NCCL buffers, other processes), both now, from cudaMemGetInfo.
    - ``peak_*``: the peak since the process started or since the last ``reset_peaks()``.
    - A statistic this rank lacks (no CUDA in use, a name torch does not produce) is
      present with the value ``MISSING`` (NaN), which the reduction ignores.

    Args:
        memory_keys: torch statistic name -> logged name. Replaces ``DEFAULT_MEMORY_KEYS``
            (used for None or an empty mapping); extend it with
            ``{**DEFAULT_MEMORY_KEYS, ...}``. A name torch cannot produce warns once
            (UserWarning) and is reported as ``MISSING``.

    Returns:
        A new dict of floats (GB, or NaN) and ints (counters).

    Raises:
        TypeError: a ``memory_keys`` entry that is not ``str -> non-empty str``.
        ValueError: a logged name reserved for host or device memory (``host_rss_gb``,
            ``peak_host_rss_gb``, ``device_used_gb``, ``device_other_gb``).
    """
    plan = _plan(tuple(memory_keys.items())) if memory_keys else _default_plan()
    device, stats = allocator_stats()
    report: dict[str, int | float] = {}
    for logged_name, path, in_bytes in plan:
        value: Any = stats
        try:
            for part in path:
                value = value[part]
        except (KeyError, TypeError):
            value = None
        if type(value) is not int:  # absent here, or a name that stops at a sub-dict
            report[logged_name] = MISSING
            continue
        if peak_counters.device and path[-1] == "peak":  # a phase reset the counter: the window's peak is kept
            value = max(value, peak_counters.device.get(path, 0))
        if in_bytes:
            report[logged_name] = value / GB
        else:
            report[logged_name] = value
    rss, peak_rss = host_rss_bytes()
    peak_rss = max(peak_rss, peak_counters.host)
    report[HOST_RSS.key] = rss / GB
    report[PEAK_HOST_RSS.key] = peak_rss / GB
    used, other = _device_usage(device, stats)
    report[DEVICE_USED.key] = MISSING if used is None else used / GB
    report[DEVICE_OTHER.key] = MISSING if other is None else other / GB
    return report


def _cuda_in_use() -> bool:
    # "In use" means this process already initialised CUDA: never create a context
    # (hundreds of MB of device memory) just to read statistics. Once true it stays
    # true in this process (a forked child has to find out again).
    if process_wide.known("cuda in use"):
        return True
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        process_wide.remember("cuda in use")
        return True
    return False


def allocator_stats() -> tuple[int | None, dict]:
    """(current device, torch's nested allocator statistics), or (None, {}) without CUDA in use."""
    if not _cuda_in_use():
        return None, {}
    device = torch.cuda.current_device()
    return device, _read_allocator(device)


def _read_allocator(device: int) -> dict:
    """The nested dict ``torch.cuda.memory_stats_as_nested_dict()`` returns, straight from
    torch's C++ side (the public function adds only argument checks)."""
    read = getattr(torch._C, "_cuda_memoryStats", None)
    return read(device) if read is not None else torch.cuda.memory_stats_as_nested_dict(device)


def _reserved_now(stats: dict) -> int:
    try:
        return stats["reserved_bytes"]["all"]["current"]
    except (KeyError, TypeError):
        return 0


def _device_usage(device: int | None, stats: dict) -> tuple[int | None, int | None]:
    """(used, other) bytes of ``device``; (None, None) without CUDA in use (device None).

    used = total - free for the whole device (what nvidia-smi shows, all processes);
    other = used - this process's reserved memory, never below 0.
    """
    if device is None or not _has_context(device, stats):
        return None, None
    free, total = _mem_get_info(device)
    used = total - free
    return used, max(0, used - _reserved_now(stats))


def _mem_get_info(device: int) -> tuple[int, int]:
    """(free, total) bytes of ``device``: the call torch.cuda.mem_get_info makes, without its
    argument handling (6 us instead of 8 on an H100, of a report's ~30)."""
    return _mem_get_info_call()(device)


@lru_cache(maxsize=1)
def _mem_get_info_call():
    return getattr(torch.cuda.cudart(), "cudaMemGetInfo", None) or torch.cuda.mem_get_info


def _has_context(device: int, stats: dict) -> bool:
    """Whether ``device`` already has this process's CUDA context. cudaMemGetInfo would
    create one otherwise, and torch.cuda.is_initialized() alone does not say (a
    torch.cuda.current_device() call initialises CUDA without a context). Once seen, a
    primary context stays for the process's life, so the answer is kept."""
    fact = ("cuda context", device)
    if process_wide.known(fact):
        return True
    check = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # CUDA builds
    found = bool(check(device)) if check is not None else _reserved_now(stats) > 0  # else: memory held there
    if found:
        process_wide.remember(fact)
    return found


def reset_peaks() -> None:
    """Start a new peak window: from now on every ``peak_*`` value is the peak since this call.

    The counters are the process's: anything else reading them (Megatron's text log,
    ``torch.cuda.max_memory_allocated``) sees them reset too. No collective.

    - CUDA: ``torch.cuda.reset_peak_memory_stats()`` on the current device, only once this
      process has initialised CUDA (never creates a context).
    - Host: writes ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), which sets VmHWM to
      the current RSS.

    Raises:
        Nothing for the host peak: where it cannot be reset (no ``/proc``, as on macOS; a
        kernel or sandbox refusing the write) ``peak_host_rss_gb`` stays the process's
        lifetime peak, and this warns once per process.
    """
    peak_counters.clear()
    if _cuda_in_use():
        torch.cuda.reset_peak_memory_stats()
    problem = reset_host_peak()
    if problem is not None:
        peak_counters.warnings(
            "host peak reset",
            f"memory_peak_window='interval' cannot reset the host peak here: {problem}. "
            "peak_host_rss_gb stays the process's lifetime peak; CUDA peaks (if any) are still reset.",
        )


class PeakCounters:
    """What this module keeps of the process's peak counters: the peaks read and reset in the
    middle of a peak window (by a memory phase, measure/phase.py), in bytes: ``device`` by their
    path in torch's nested statistics, ``host`` the VmHWM. report_memory reports the max of these
    and the counters, so that a phase's reset loses nothing of the window's peak; reset_peaks()
    starts the window anew. Also the warnings about the counters, once per process."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child's counters start from its parent's: it clears these first
        self.device: dict[tuple[str, ...], int] = {}
        self.host = 0
        self.warnings = WarnOnce()
        # Whether a memory phase may reset the CUDA peak counters: only once a run of this process
        # logs interval peaks (memory_peak_window="interval"), which resets them at every logging
        # step anyway. Under the default "run" window the counters stay as every other reader of
        # them (torch.cuda.max_memory_allocated, Lightning's DeviceStatsMonitor) expects.
        self.device_resets = False

    def clear(self) -> None:
        self.pid = os.getpid()
        self.device.clear()
        self.host = 0


# Per process, not per run: the counters (torch's allocator statistics, the host's VmHWM) are the
# process's, read and reset by every run and memory phase in it alike.
peak_counters = PeakCounters()


def fold_peaks() -> tuple[dict, int]:
    """Read every peak counter now, keep each in ``peak_counters`` (max), and reset the counters, so that
    from now on they measure a new span (a memory phase) while report_memory still reports the
    window's peak. Returns (the device peaks read, by path; {} without CUDA in use, or while no run
    of this process logs interval peaks: the CUDA counters are then left alone, see
    PeakCounters.device_resets; the host peak read in bytes). Never creates a CUDA context; no
    collective."""
    kept = peak_counters
    if kept.pid != os.getpid():
        kept.clear()
    device_peaks = {}
    device, stats = allocator_stats() if kept.device_resets else (None, {})
    if device is not None:
        for kind, pools in stats.items():
            if isinstance(pools, dict) and isinstance(pools.get("all"), dict) and "peak" in pools["all"]:
                path = (kind, "all", "peak")
                device_peaks[path] = pools["all"]["peak"]
                kept.device[path] = max(kept.device.get(path, 0), device_peaks[path])
        torch.cuda.reset_peak_memory_stats()
    host = host_rss_bytes()[1]
    kept.host = max(kept.host, host)
    reset_host_peak()  # where it cannot be reset the lifetime peak stays: phases then see it too
    return device_peaks, host


def reset_host_peak() -> str | None:
    """Reset this process's VmHWM to its current RSS. None on success, else why not."""
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
    except OSError as error:
        return f"/proc/self/clear_refs cannot be opened ({error.strerror})"
    try:
        os.write(fd, b"5")
    except OSError as error:
        return f"writing 5 to /proc/self/clear_refs failed ({error.strerror}; Linux >= 4.0 needed)"
    finally:
        os.close(fd)
    return None


@lru_cache(maxsize=16)
def _plan(keys: tuple[tuple[str, str], ...]) -> tuple[tuple[str, tuple[str, ...], bool], ...]:
    """Check a memory_keys mapping and resolve each name to its path in torch's nested
    statistics, once per distinct mapping (cached): ``reserved_bytes.all.peak`` ->
    ``("reserved_bytes", "all", "peak")``, as torch.cuda.memory_stats() joins them.
    Entries: (logged name, path, whether the value is a byte count)."""
    for stat_name, logged_name in keys:
        if not isinstance(stat_name, str) or not isinstance(logged_name, str) or not logged_name:
            raise TypeError(
                f"memory_keys must map torch statistic names to non-empty logged names (str -> str); "
                f"got {stat_name!r} -> {logged_name!r}"
            )
        if not _TORCH_STAT.match(stat_name):
            misuse(
                f"memory_keys: {stat_name!r} is not a torch.cuda.memory_stats() statistic; "
                f"{logged_name!r} will be reported as missing. Known names look like "
                f"'reserved_bytes.all.peak' or 'num_alloc_retries'.",
                stacklevel=3,
            )
        if logged_name in HOST_KEYS + DEVICE_KEYS:
            raise ValueError(
                f"memory_keys: {logged_name!r} is reserved for host and device memory; choose another name"
            )
    return tuple((logged_name, tuple(stat_name.split(".")), "bytes" in stat_name) for stat_name, logged_name in keys)


@lru_cache(maxsize=1)
def _default_plan():
    # Resolved at the first report: the warnings of _plan, if any, go to its caller.
    return _plan(tuple(DEFAULT_MEMORY_KEYS.items()))


def host_rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes, from the OS."""
    rss, peak = proc_fields("/proc/self/status", (b"VmRSS:", b"VmHWM:"), 1024)
    if rss is not None and peak is not None:
        return rss, peak
    import resource  # not Linux: peak only, from getrusage

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if os.uname().sysname == "Darwin" else 1024
    return peak, peak


@lru_cache(maxsize=1)
def host_total_bytes() -> int:
    """Physical RAM of this machine in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_total_bytes() -> int | None:
    """Total memory of the current CUDA device, or None without CUDA in use."""
    if _cuda_in_use():
        return _device_total(torch.cuda.current_device())
    return None


@cache
def _device_total(device: int) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def capacity_report() -> dict[str, float]:
    """Return what this rank could use, in GB (1e9 bytes).

    - ``device_total_gb``: the current CUDA device's memory; NaN until this process has
      initialised CUDA.
    - ``host_total_gb``: the machine's physical RAM.
    - ``host_available_gb``: the kernel's MemAvailable, shared by every rank on the node:
      the distance to the OOM killer (SIGKILL).
    - ``host_limit_gb``, ``host_limit_used_gb``: the limit and usage of the memory cgroup
      whose limit binds this process (SLURM, Kubernetes, a container), where the OOM killer
      fires first; NaN without one, or where the cgroup files cannot be read.

    No collective; never creates a CUDA context.
    """
    device_total = device_total_bytes()
    limit = host_limit_bytes()
    return {
        DEVICE_TOTAL.key: MISSING if device_total is None else device_total / GB,
        HOST_TOTAL.key: host_total_bytes() / GB,
        HOST_AVAILABLE.key: host_available_bytes() / GB,
        HOST_LIMIT.key: MISSING if limit is None else limit[0] / GB,
        HOST_LIMIT_USED.key: MISSING if limit is None else limit[1] / GB,
    }


def host_limit_bytes() -> tuple[int, int] | None:
    """(limit, usage) of the memory cgroup whose limit binds this process (rank/host_limit.py), in
    bytes; None without one (no cgroup limit below the machine's RAM, or unreadable)."""
    limit = limit_of_process(os.getpid(), host_total_bytes())
    return None if limit is None else limit.read()


def host_cgroup_peak() -> tuple[str, float] | None:
    """(the binding memory cgroup as "<host>:<folder>", its own peak charge in GB: NaN where the
    kernel keeps none) for the per-layer record; None without a limit. The ranks of a node that
    name the same cgroup share its charge: shared pages once, as the kernel counts them."""
    limit = limit_of_process(os.getpid(), host_total_bytes())
    binding = None if limit is None or limit.read() is None else limit.binding()
    if binding is None:
        return None
    peak = binding.peak_bytes()
    return f"{os.uname().nodename}:{binding.folder}", MISSING if peak is None else peak / GB


def host_available_bytes() -> int:
    available = proc_field("/proc/meminfo", b"MemAvailable:", 1024)
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
