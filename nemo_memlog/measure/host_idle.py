"""The process's idle host size on CPU: its resident memory when no microbatch is held, read at the
start of a measured iteration (before its first microbatch's forward) after handing the C heap's
free pages back to the kernel (glibc's ``malloc_trim``), so that what the previous iteration freed
and the heap kept is not counted as idle. What the process's peak holds beyond it, less the
activations, is the working set of the microbatch being computed (advice/: ``temporaries_gb`` on
CPU), which grows with the microbatch's size.

Read only on a process that uses no GPU (its host memory is the capacity there); costs one
``malloc_trim`` (a few ms) and one read of /proc per measured logging iteration. Never raises.

Known limitations: without glibc (musl, macOS) nothing is trimmed, and the figure is not taken
(None); memory a library maps and keeps (an arena of its own) counts as idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

GB = 1e9


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def idle_rss_gb() -> float | None:
    """This process's resident memory now, after trimming the C heap (GB), or None where it cannot
    be trimmed or read."""
    trim = _malloc_trim()
    if trim is None:
        return None
    try:
        trim(0)
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE") / GB
    except (OSError, ValueError, IndexError):
        return None
