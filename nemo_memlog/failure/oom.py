"""CUDA out-of-memory, on every rank: the allocator's OOM observer writes an ``oom`` record.

torch calls ``observer(device, bytes_requested, device_limit, device_free)`` on the failing
rank, after the allocator gave up and released its lock, before ``torch.OutOfMemoryError``
unwinds. ``device_limit`` is the device's total, or the per-process limit when one is set.
Each open FlightRecorder registers its own observer (``watch``) with process_wide.py, which
attaches one dispatching observer per process; for that recorder, ``record``:

- takes the allocator snapshot (``torch.cuda.memory._snapshot()``: about 1 ms without
  history), writes it beside the records as ``rank-<rank>.oom-<n>.pickle`` (the format
  ``torch.cuda.memory._dump_snapshot`` writes; open it at https://pytorch.org/memory_viz),
  and reads from its segments the largest free block and the bytes free inside reserved
  segments (fragmentation: plenty free, no block large enough);
- writes an ``oom`` record with those, the request, and this rank's full report.

Observers are appended, never replaced: Megatron-Bridge's, Composer's or the user's own keep
firing, in the order they were attached. torch attaches an observer only to devices whose
allocator exists, so ``watch`` attaches once CUDA is initialised in this process (at once, or
at the recorder's next record: ``attach_when_ready``). Never raises: an OOM must surface as
torch's own error. This module knows the recorder only through ``Target``: it imports none.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Protocol

from .. import process_wide

#: Snapshots written per recorder: a loop that catches OOMs and retries must not fill the disk.
MAX_SNAPSHOTS = 3


class Target(Protocol):
    """What ``record`` needs of a recorder (FlightRecorder has it)."""

    directory: str
    oom_count: int  # OOM records written so far
    report: Callable[[], dict]  # this rank's report now

    @property
    def is_open(self) -> bool: ...

    def snapshot_name(self, n: int) -> str: ...

    def record_oom(self, fields: dict, report: dict) -> None: ...


def watch(
    observer: Callable[[int, int, int, int], object],
    *,
    warn: Callable[[str, str], object],
    record_history: bool = False,
) -> bool:
    """Have ``observer(device, bytes_requested, device_limit, device_free)`` called on a CUDA
    OOM in this process (process_wide holds it weakly when it is a bound method).
    ``record_history`` turns on the allocator's alloc/free history
    (torch.cuda.memory._record_memory_history) for this process. ``warn(key, text)`` (a
    WarnOnce) says what could not be done. True when the observer still waits for CUDA to be
    initialised (call attach_when_ready later)."""
    import torch

    if not torch.cuda.is_available():
        process_wide.on_cuda_oom(observer)  # registered all the same: nothing will call it
        if record_history:
            warn("history", "memory_record_history=True has no effect: CUDA is not available")
        return False
    if record_history:
        _record_history(torch, warn)
    return not _attached(process_wide.on_cuda_oom(observer), warn)


def attach_when_ready(*, warn: Callable[[str, str], object]) -> bool:
    """Attach the process's observer if CUDA is initialised here; True once attached."""
    return _attached(process_wide.attach_cuda_oom_observer(), warn)


def _attached(attached: bool, warn) -> bool:
    error = process_wide.cuda_oom_attach_error()
    if attached and error:  # a torch without it, or another allocator backend: records go on without
        warn("observer", f"cannot attach the CUDA OOM observer ({error}); a CUDA OOM will leave no oom record")
    return attached


def _record_history(torch, warn) -> None:
    # The allocator's alloc/free history is one switch for the whole process: started at most
    # once, whichever recorder asks first.
    if process_wide.known("cuda_memory_history"):
        return
    try:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        process_wide.remember("cuda_memory_history")
    except Exception as error:  # an allocator built without it (e.g. cudaMallocAsync)
        warn("history", f"memory_record_history=True could not start the allocator's history ({error})")


def record(target: Target, device: int, bytes_requested: int, device_limit: int, device_free: int) -> None:
    """Write an ``oom`` record into ``target``: the request, the allocator snapshot (for the
    first MAX_SNAPSHOTS), and the rank's report. Nothing when ``target`` is closed. Never raises."""
    try:
        if not target.is_open:
            return
        fields = {
            "device": int(device),
            "bytes_requested": int(bytes_requested),
            "device_limit": int(device_limit),
            "device_free": int(device_free),
        }
        if target.oom_count < MAX_SNAPSHOTS:
            fields.update(snapshot(target.directory, target.snapshot_name(target.oom_count)))
        try:
            report = target.report()
        except Exception:
            report = {}
        target.record_oom(fields, report)
    except Exception:  # the OOM itself is what the user must see
        pass


def snapshot(directory: str, name: str) -> dict:
    """Take the allocator snapshot and write it to ``directory/name``: ``{"snapshot": name}``
    once written, plus what its segments say (free_blocks); {} without one. Never raises."""
    import torch

    try:
        taken = torch.cuda.memory._snapshot()
    except Exception:
        return {}
    found = free_blocks(taken)
    try:
        with open(os.path.join(directory, name), "wb") as out:
            pickle.dump(taken, out)
        found["snapshot"] = name
    except OSError:
        pass
    return found


def free_blocks(snapshot: dict) -> dict:
    """``largest_free_block`` and ``reserved_free`` (bytes) from an allocator snapshot's segments:
    the free ("inactive") blocks inside memory the allocator already reserved."""
    largest = total = 0
    for segment in snapshot.get("segments", ()):
        blocks = segment.get("blocks")
        if blocks is None:  # older layouts: the segment's own totals
            free = segment.get("total_size", 0) - segment.get("allocated_size", 0)
            largest, total = max(largest, free), total + free
            continue
        for block in blocks:
            if block.get("state") == "inactive":
                largest, total = max(largest, block.get("size", 0)), total + block.get("size", 0)
    return {"largest_free_block": int(largest), "reserved_free": int(total)}
