"""CUDA out-of-memory, on every rank: the allocator's OOM observer writes an ``oom`` record.

torch calls ``observer(device, bytes_requested, device_limit, device_free)`` on the failing
rank, after the allocator gave up and released its lock, before ``torch.OutOfMemoryError``
unwinds. ``device_limit`` is the device's total, or the per-process limit when one is set.
The observer then, for every open FlightRecorder of this process:

- takes the allocator snapshot (``torch.cuda.memory._snapshot()``: about 1 ms without
  history), writes it beside the records as ``rank-<rank>.oom-<n>.pickle`` (the format
  ``torch.cuda.memory._dump_snapshot`` writes; open it at https://pytorch.org/memory_viz),
  and reads from its segments the largest free block and the bytes free inside reserved
  segments (fragmentation: plenty free, no block large enough);
- writes an ``oom`` record with those, the request, and this rank's full report.

Observers are appended, never replaced: Megatron-Bridge's, Composer's or the user's own keep
firing, in the order they were attached. torch attaches an observer only to devices whose
allocator exists, so ``watch`` attaches once CUDA is initialised in this process (at once, or
at the recorder's next record). Never raises: an OOM must surface as torch's own error.
"""

from __future__ import annotations

import os
import pickle
import weakref

from .. import process_wide

#: Snapshots written per process: a loop that catches OOMs and retries must not fill the disk.
MAX_SNAPSHOTS = 3

_recorders: "weakref.WeakSet" = weakref.WeakSet()
_history_on = False


def watch(recorder, record_history: bool = False) -> bool:
    """Have the OOM observer write into ``recorder``. ``record_history`` turns on the
    allocator's alloc/free history (torch.cuda.memory._record_memory_history) for this process.
    True when the observer still waits for CUDA to be initialised (call attach_when_ready later)."""
    import torch

    _recorders.add(recorder)
    if not torch.cuda.is_available():
        if record_history:
            _warn("history", "memory_record_history=True has no effect: CUDA is not available")
        return False
    if record_history:
        _record_history(torch)
    return not attach_when_ready()


def attach_when_ready() -> bool:
    """Attach the observer if CUDA is initialised here (once per process); True once attached."""
    attached = process_wide.on_cuda_oom(on_oom)
    error = process_wide.cuda_oom_attach_error()
    if attached and error:  # a torch without it, or another allocator backend: records go on without
        _warn("observer", f"cannot attach the CUDA OOM observer ({error}); a CUDA OOM will leave no oom record")
    return attached


def _record_history(torch) -> None:
    global _history_on
    if _history_on:
        return
    try:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        _history_on = True
    except Exception as error:  # an allocator built without it (e.g. cudaMallocAsync)
        _warn("history", f"memory_record_history=True could not start the allocator's history ({error})")


def _warn(kind: str, text: str) -> None:
    from .recorder import _warn as warn_once

    warn_once(kind, text)


def on_oom(device: int, bytes_requested: int, device_limit: int, device_free: int) -> None:
    """The observer torch calls. Never raises."""
    for recorder in list(_recorders):
        try:
            _record(recorder, device, bytes_requested, device_limit, device_free)
        except Exception:  # the OOM itself is what the user must see
            pass


def _record(recorder, device, bytes_requested, device_limit, device_free) -> None:
    if recorder._fd is None:
        return
    fields = {"device": int(device), "bytes_requested": int(bytes_requested), "device_limit": int(device_limit),
              "device_free": int(device_free)}
    if recorder.oom_count < MAX_SNAPSHOTS:
        fields.update(_snapshot(recorder))
    try:
        report = recorder.report()
    except Exception:
        report = {}
    recorder.record_oom(fields, report)


def _snapshot(recorder) -> dict:
    """Take and write the allocator snapshot; its file name and what its segments say."""
    import torch

    try:
        snapshot = torch.cuda.memory._snapshot()
    except Exception:
        return {}
    found = free_blocks(snapshot)
    name = f"{os.path.splitext(os.path.basename(recorder.path))[0]}.oom-{recorder.oom_count}.pickle"
    try:
        with open(os.path.join(recorder.directory, name), "wb") as out:
            pickle.dump(snapshot, out)
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
