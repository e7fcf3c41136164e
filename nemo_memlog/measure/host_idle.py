"""The process's idle host size on CPU: its resident memory when no microbatch is held, read at the
start of a measured iteration (before its first microbatch's forward), less what the C heap holds
free (glibc's ``mallinfo2``: the bytes in free chunks, which the previous iteration freed and the
heap kept resident), so that memory the heap keeps for reuse is not counted as idle. What the
process's peak holds beyond it, less the activations, is the working set of the microbatch being
computed (advice/: ``temporaries_gb`` on CPU), which grows with the microbatch's size.

Read only on a process that uses no GPU (its host memory is the capacity there); costs one
``mallinfo2`` (a walk of the heap's bins, no system call) and one read of /proc per measured logging
iteration; changes nothing in the process (no trim: the heap keeps what it keeps). Never raises.

Known limitations: without glibc 2.33+ (musl, macOS, older glibc) the figure is not taken (None);
memory another allocator keeps free (jemalloc, tcmalloc, a library's own arena) counts as idle;
a free chunk whose pages were never touched is subtracted though it is not resident (on this
project's CPU runs the result was within 1-3% of the resident size after ``malloc_trim``).
"""

from __future__ import annotations

import ctypes
import functools
import os

GB = 1e9


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


@functools.lru_cache(maxsize=1)
def _mallinfo2():
    """glibc's mallinfo2, or None where the C library has none."""
    try:
        function = ctypes.CDLL(None).mallinfo2  # the process's own symbols: libc's, with no ldconfig run
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return function


def idle_rss_gb() -> float | None:
    """This process's resident memory now less the C heap's free bytes (GB), or None where either
    cannot be read."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    try:
        free = mallinfo2().fordblks
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
        return max(pages * os.sysconf("SC_PAGE_SIZE") - free, 0) / GB
    except (OSError, ValueError, IndexError):
        return None
