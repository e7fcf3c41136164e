"""FlightRecorder: this rank's recent memory history, in a file of its own that survives a SIGKILL.

The writing side of the failure path (records.py is the format, offline/postmortem/__init__.py the
reader; identity.py says who writes, evidence.py what the host shows, oom.py what a CUDA OOM
adds):

- One file per rank, ``<dir>/rank-<global rank>.memrec``, created at its full, fixed size when
  the recorder opens, with a header saying who wrote it (run id, ranks, host, pid).
- ``record(iteration, report)`` writes one step record into the next ring slot with one
  ``os.pwrite``: one ``json.dumps`` and one system call, no fsync. The pages stay in the
  kernel's page cache when the process is killed (the OOM killer, the scheduler), so the
  post-mortem reads them afterwards.
- A daemon thread rewrites the liveness slot about once a second (time, host MemAvailable,
  this process's RSS, the kernel's and the job cgroup's OOM-kill counters). The rank whose
  liveness stopped first is the one that died first, even when every stage stopped in the
  same iteration. The thread only reads /proc and calls pwrite (both release the GIL), so it
  keeps beating while the training thread waits in a collective.
- ``end(reason)`` writes an end marker: ``close`` (close()), ``sigterm`` (SIGTERM),
  ``exit`` (interpreter exit without close), ``exception`` (an unhandled exception in the
  main thread). Each open recorder registers these hooks, and its CUDA OOM observer, with
  process_wide.py, and unregisters them when it shuts. A file without an end marker belongs
  to a process that died without a trace (``abandon()`` leaves one so, on purpose).

Contract: no collective, ever (the other ranks are usually stuck in one when this matters);
nothing raises into training: a folder that cannot be written warns once and records
nothing, an I/O error later warns once and stops recording.

Custom training loops::

    recorder = nemo_memlog.FlightRecorder("runs/x/memory_records", pp_group=pp_group)
    ...
    recorder.record(iteration, nemo_memlog.report_memory())   # whenever you log memory
    ...
    recorder.close()
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import process_wide
from ..commands import postmortem_command
from ..keys import (
    ALLOC_RETRIES,
    CURRENT_ALLOCATED,
    CURRENT_RESERVED,
    DEVICE_OTHER,
    DEVICE_TOTAL,
    DEVICE_USED,
    HOST_AVAILABLE,
    HOST_RSS,
    HOST_TOTAL,
    NUM_OOMS,
    PEAK_ALLOCATED,
    PEAK_HOST_RSS,
    PEAK_RESERVED,
)
from ..warn import WarnOnce
from . import oom, records
from .evidence import HostEvidence
from .identity import identity as rank_identity

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

LIVENESS_PERIOD_S = 1.0
#: Report keys kept when a record does not fit its slot (the rest are dropped, "truncated": true).
ESSENTIAL_KEYS = (
    PEAK_RESERVED.key,
    PEAK_ALLOCATED.key,
    CURRENT_RESERVED.key,
    CURRENT_ALLOCATED.key,
    NUM_OOMS.key,
    ALLOC_RETRIES.key,
    HOST_RSS.key,
    PEAK_HOST_RSS.key,
    HOST_AVAILABLE.key,
    HOST_TOTAL.key,
    DEVICE_TOTAL.key,
    DEVICE_USED.key,
    DEVICE_OTHER.key,
)

# Per process, not per run: every recorder this process opened (a custom loop's own
# FlightRecorder too), weakly (the runs own their recorders, this only finds them). A memory phase
# (measure/phase.py), which belongs to the process, is recorded in each; and this rank's file in a
# folder is one file, which two recorders would overwrite each other's slots of, so open_recorder
# hands every run that asks for a folder the shared recorder already open there.
_opened: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()


class FlightRecorder:
    """This rank's flight record, ``<directory>/rank-<global rank>.memrec``, for ``nemo-memlog postmortem``.

    Opens the file at its full, fixed size, starts a liveness thread (a beat about once a
    second) and, with CUDA, an OOM observer. ``record(iteration, report)`` writes one step;
    ``close()`` marks the end. No collective, ever.

    Args:
        directory: the folder (created if needed).
        pp_group: the pipeline group, for the coordinates in the header (default:
            megatron-core's parallel_state where initialised, else 0).
        pg_collection: megatron-core's process groups, the same use.
        report: builds the report an OOM record holds (default: ``report_memory()`` +
            ``capacity_report()``).
        record_history: record the CUDA allocator's alloc/free history, so that an OOM
            snapshot holds stack traces; costs time at every allocation (docs/postmortem.md).
        slots, slot_bytes: the ring of step records: how many, and the size of each.
        liveness_period_s: seconds between liveness beats.
        identity: the header's who-am-I (identity.identity()'s keys; default: from the groups).
        clock: a ``time.time``-like callable for every time written.
        liveness: False: no liveness thread (for tests: write beats with ``write_liveness``).
        warn: the WarnOnce its warnings go through (default: its own).

    Raises:
        Nothing for I/O: a folder that cannot be written warns once and the recorder records
        nothing; an I/O error later warns once and stops recording.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        pp_group: ProcessGroup | None = None,
        pg_collection: Any = None,
        report: Callable[[], dict] | None = None,
        record_history: bool = False,
        slots: int = records.DEFAULT_SLOTS,
        slot_bytes: int = records.DEFAULT_SLOT_BYTES,
        liveness_period_s: float = LIVENESS_PERIOD_S,
        identity: dict | None = None,
        clock: Callable[[], float] = time.time,
        liveness: bool = True,
        warn: WarnOnce | None = None,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.slots, self.slot_bytes, self.liveness_period_s = slots, slot_bytes, liveness_period_s
        self.report = report or _default_report
        self.clock = clock
        self.warn = warn or WarnOnce()
        self.iteration = None  # the last iteration recorded: an OOM record names it
        self.phases: list[dict] = []  # the memory phases this rank is in (measure/phase.py), innermost last
        self.ended = None  # the end reason written, if any
        self.oom_count = 0
        self._fd = None
        # Record numbers: next() is atomic, so the training thread, the OOM observer and a signal
        # handler interrupting either each get a slot of their own, without a lock to deadlock on.
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._thread = None
        self._users = 1  # open_recorder shares an open recorder: the last user's close ends it
        self._shared = False  # opened by open_recorder, for every run that asks for its folder
        self._oom_pending = False  # CUDA available but not initialised yet: attach at a later record
        who = identity if identity is not None else rank_identity(pp_group, pg_collection)
        self.rank = who["rank"]
        self.path = os.path.join(self.directory, records.file_name(self.rank))
        self.header = {
            "format": records.FORMAT,
            "version": records.VERSION,
            **who,
            "pid": os.getpid(),
            "started": clock(),
            "slots": slots,
            "slot_bytes": slot_bytes,
            "liveness_period_s": liveness_period_s,
        }
        if self._open_file():
            _opened.add(self)
            self._register_hooks()
            if liveness:
                self._thread = _Liveness(self)
                self._thread.start()
            self._oom_pending = oom.watch(self.on_cuda_oom, warn=self.warn, record_history=record_history)

    # -- what others read --------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        """True while the recorder writes (opened, not yet ended, closed, abandoned or failed)."""
        return self._fd is not None

    def fileno(self) -> int | None:
        """The open file's descriptor (None once shut): for a test that stands in a failing disk."""
        return self._fd

    def snapshot_name(self, n: int) -> str:
        """The file name, beside the records, of this rank's ``n``-th OOM snapshot."""
        return f"{os.path.splitext(records.file_name(self.rank))[0]}.oom-{n}.pickle"

    # -- the per-step path -------------------------------------------------------------------

    def record(self, iteration: int, report: dict) -> None:
        """Write a step record: ``report`` (plain numbers) at ``iteration``. One json.dumps and
        one pwrite; no fsync, no collective; never raises."""
        self.iteration = iteration
        if self._oom_pending:
            self._oom_pending = not oom.attach_when_ready(warn=self.warn)
        if self._fd is not None:
            self._write({"kind": "step", "time": self.clock(), "iteration": iteration, "report": report})

    def phase(self, name: str, event: str, iteration: int | None, started: float) -> None:
        """Write a ``phase`` record (measure/phase.py's start or end of ``name``) and keep the phases this
        rank is in for the liveness beat. Never raises."""
        at = self.iteration if iteration is None else iteration
        if event == "start":
            self.phases.append({"phase": name, "phase_started": started, "phase_iteration": at})
        else:
            self.phases = [p for p in self.phases if (p["phase"], p["phase_started"]) != (name, started)]
        if self._fd is not None:
            record = {"kind": "phase", "time": self.clock(), "iteration": at, "report": {}}
            self._write(record | {"name": name, "event": event, "started": started})

    def write_liveness(self, liveness: dict) -> None:
        """Rewrite the liveness slot with ``liveness`` (records.py's liveness object). Never raises."""
        fd = self._fd
        if fd is None:
            return
        try:
            os.pwrite(fd, records.encode(liveness, records.LIVENESS_BYTES), records.HEADER_BYTES)
        except (OSError, records.RecordError) as error:
            self._fail(error)

    # -- the failure path --------------------------------------------------------------------

    def on_cuda_oom(self, device: int, bytes_requested: int, device_limit: int, device_free: int) -> None:
        """The CUDA allocator's OOM observer for this recorder (process_wide calls it with
        torch's arguments): an ``oom`` record and a snapshot (oom.record). Never raises."""
        oom.record(self, device, bytes_requested, device_limit, device_free)

    def record_oom(self, fields: dict, report: dict) -> None:
        """Write an ``oom`` record: ``fields`` (records.py's oom fields) and ``report``."""
        self.oom_count += 1
        if self._fd is not None:
            self._write({"kind": "oom", "time": self.clock(), "iteration": self.iteration, "report": report, **fields})

    def end(self, reason: str, detail: str = "") -> None:
        """Write the end marker ``reason`` (one of records.END_REASONS). After "sigterm" the
        recorder stays open (a framework's own handler may let training go on, and a later
        record then says so); any other reason closes it. Never raises."""
        if self._fd is None:
            return
        self.ended = reason
        self._write(
            {
                "kind": "end",
                "time": self.clock(),
                "iteration": self.iteration,
                "report": {},
                "reason": reason,
                "detail": detail[:500],
                **_counters(),  # a host-mate killed just before: this end may be the only later sight of it
            }
        )
        if reason != "sigterm":
            self._shut()

    def close(self) -> None:
        """End with reason "close" (when the last user of a shared recorder closes it)."""
        self._users -= 1
        if self._users <= 0:
            self.end("close")

    def abandon(self) -> None:
        """Leave the file as a SIGKILL would: stop the liveness thread and close the file with
        no end marker (a simulation of a rank that dies; a run ends with close()). Never raises."""
        self._shut()

    # -- internals ---------------------------------------------------------------------------

    def _open_file(self) -> bool:
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.ftruncate(fd, 0)  # a previous run's records in this file must not survive
                os.ftruncate(fd, records.file_bytes(self.slots, self.slot_bytes))
                os.pwrite(fd, records.encode(self.header, records.HEADER_BYTES), 0)
            except BaseException:
                os.close(fd)
                raise
        except (OSError, records.RecordError) as error:
            self.warn(
                "open",
                f"cannot write flight records to {self.path} ({error}); training goes on without "
                f"them (set logger.memory_record_dir to a writable folder, or to 'off')",
                stacklevel=3,
            )
            return False
        self._fd = fd
        return True

    def _write(self, obj: dict) -> None:
        fd = self._fd
        if fd is None:
            return
        seq = next(self._seq)
        slot = _encoded({"seq": seq, **obj}, self.slot_bytes)
        try:
            os.pwrite(fd, slot, records.record_offset(seq, self.slots, self.slot_bytes))
        except OSError as error:
            self._fail(error)

    def _fail(self, error) -> None:
        self.warn(
            "write",
            f"writing flight records to {self.path} failed ({error}); recording stops, training goes on",
            stacklevel=3,
        )
        self._shut()

    def _shut(self) -> None:
        """Stop writing: unregister the hooks, stop the thread, close the file. Writes nothing."""
        fd, self._fd = self._fd, None
        self._stop.set()
        for callback in (self._on_exit, self._on_exception, self._on_sigterm, self.on_cuda_oom):
            process_wide.forget(callback)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
            if thread.is_alive():
                return  # it may still write: leave the descriptor open rather than let it be reused
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    # -- exit paths: end markers at interpreter exit, on an unhandled exception in the main
    # thread, and on SIGTERM (first, before the writers drain); held weakly by process_wide.

    def _register_hooks(self) -> None:
        process_wide.on_exit(self._on_exit)
        process_wide.on_exception(self._on_exception)
        process_wide.on_sigterm(self._on_sigterm, first=True)

    def _on_exit(self) -> None:
        self.end("exit")

    def _on_exception(self, kind, value, traceback) -> None:
        if process_wide.ending_by_signal():  # a SIGTERM ends the process: an error on the way is its doing
            return
        self.end("exception", f"{kind.__name__}: {value}")

    def _on_sigterm(self) -> None:
        self.end("sigterm")


def open_recorders() -> list[FlightRecorder]:
    """The recorders open in this process (measure/phase.py records its phases in each)."""
    return [recorder for recorder in list(_opened) if recorder.is_open]


def open_recorder(directory: str | os.PathLike[str], **kwargs: Any) -> FlightRecorder:
    """The recorder for ``directory`` in this process: a new one (``kwargs`` as FlightRecorder
    takes them), or the one already open there (shared: each user closes it once, the last
    close ends it). Rank 0 says on stderr where a newly opened file's folder is."""
    path = os.path.abspath(os.fspath(directory))
    shared = [recorder for recorder in list(_opened) if recorder._shared and recorder.directory == path]
    recorder = next((recorder for recorder in shared if recorder.is_open), None)
    if recorder is not None:
        recorder._users += 1
        return recorder
    recorder = FlightRecorder(path, **kwargs)
    if recorder.is_open:
        recorder._shared = True
        if recorder.rank == 0:
            print(
                f"nemo_memlog: memory flight records in {path} (after a failure: {postmortem_command(path)})",
                file=sys.stderr,
                flush=True,
            )
    return recorder


def _encoded(obj: dict, size: int) -> bytes:
    """``obj`` in a slot of ``size`` bytes; a report too large keeps ESSENTIAL_KEYS only."""
    try:
        return records.encode(obj, size)
    except (records.RecordError, TypeError, ValueError):
        report = obj.get("report") or {}
        smaller = {key: _plain(report[key]) for key in ESSENTIAL_KEYS if key in report}
        for kept in (smaller, {}):
            try:
                return records.encode({**obj, "report": kept, "truncated": True}, size)
            except (records.RecordError, TypeError, ValueError):
                continue
        return records.encode(
            {
                "seq": obj["seq"],
                "kind": obj["kind"],
                "time": obj["time"],
                "iteration": obj.get("iteration"),
                "report": {},
                "truncated": True,
            },
            size,
        )


def _plain(value):
    return value if isinstance(value, (int, float, str, type(None))) else str(value)


def _default_report() -> dict:
    from ..rank.memory import capacity_report, report_memory

    report = report_memory()
    report.update(capacity_report())
    return report


def _counters() -> dict:
    """The OOM-kill counters now (host and memory cgroup), for an end record. Never raises."""
    try:
        evidence = HostEvidence().read()
    except Exception:
        return {}
    return {key: evidence.get(key) for key in ("vmstat_oom_kill", "cgroup_oom_kill")}


class _Liveness(threading.Thread):
    """Rewrites the recorder's liveness slot every ``liveness_period_s`` until it is shut. Holds
    the recorder weakly: a recorder dropped without close() stops its thread too."""

    def __init__(self, recorder: FlightRecorder):
        super().__init__(name="nemo_memlog-liveness", daemon=True)
        self.recorder = weakref.ref(recorder)
        self.stop = recorder._stop
        self.period = recorder.liveness_period_s
        self.clock = recorder.clock
        self.evidence = HostEvidence()

    def run(self) -> None:
        beats = 0
        while True:
            recorder = self.recorder()
            if recorder is None or self.stop.is_set():
                break
            beats += 1
            try:
                phases = recorder.phases  # the innermost phase this rank is in, if any
                beat = {"alive": self.clock(), "beats": beats, "iteration": recorder.iteration}
                beat.update(self.evidence.read(), **(phases[-1] if phases else {}))
                recorder.write_liveness(beat)
            except Exception:  # never let this thread die noisily; the next beat tries again
                pass
            del recorder
            if self.stop.wait(self.period):
                break
