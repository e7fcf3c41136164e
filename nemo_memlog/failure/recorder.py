"""FlightRecorder: this rank's recent memory history, in a file of its own that survives a SIGKILL.

The writing side of the failure path (records.py is the format, postmortem.py the reader):

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
- ``end(reason)`` writes an end marker: ``close`` (close()), ``sigterm`` (our SIGTERM
  handler), ``exit`` (interpreter exit without close), ``exception`` (an unhandled exception
  in the main thread). A file without one belongs to a process that died without a trace.
- On CUDA, the allocator's OOM observer (oom.py) writes an ``oom`` record and a snapshot.

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
import socket
import sys
import threading
import time
import uuid
import warnings
import weakref

from .. import process_wide
from ..process_wide import read_proc
from . import oom, records

GB = 1e9
#: The store key every rank of one run agrees on its run id through (compare_set: no collective).
RUN_ID_KEY = "nemo_memlog/run_id"
LIVENESS_PERIOD_S = 1.0
#: Report keys kept when a record does not fit its slot (the rest are dropped, "truncated": true).
ESSENTIAL_KEYS = ("peak_reserved_gb", "peak_allocated_gb", "current_reserved_gb", "current_allocated_gb",
                  "num_ooms", "alloc_retries", "host_rss_gb", "peak_host_rss_gb", "host_available_gb",
                  "host_total_gb", "device_total_gb", "device_used_gb", "device_other_gb")

_open: "weakref.WeakSet[FlightRecorder]" = weakref.WeakSet()
_by_path: "weakref.WeakValueDictionary[str, FlightRecorder]" = weakref.WeakValueDictionary()
_shown_dirs: set = set()


class FlightRecorder:
    """This rank's flight record under ``directory`` (created if needed).

    ``pp_group`` / ``pg_collection`` give the coordinates written in the header (megatron-core's
    parallel_state where initialised, else 0). ``report`` builds the report an OOM record holds
    (default: report_memory() + capacity_report()). ``record_history`` turns on the CUDA
    allocator's alloc/free history, so an OOM snapshot holds traces (at its cost: README).
    Never raises for I/O: an unwritable folder warns once and the recorder records nothing.
    """

    def __init__(self, directory, *, pp_group=None, pg_collection=None, report=None, record_history: bool = False,
                 slots: int = records.DEFAULT_SLOTS, slot_bytes: int = records.DEFAULT_SLOT_BYTES,
                 liveness_period_s: float = LIVENESS_PERIOD_S):
        self.directory = os.path.abspath(os.fspath(directory))
        self.slots, self.slot_bytes, self.liveness_period_s = slots, slot_bytes, liveness_period_s
        self.report = report or _default_report
        self.iteration = None  # the last iteration recorded: an OOM record names it
        self.ended = None  # the end reason written, if any
        self.oom_count = 0
        self._fd = None
        # Record numbers: next() is atomic, so the training thread, the OOM observer and a signal
        # handler interrupting either each get a slot of their own, without a lock to deadlock on.
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._thread = None
        self._users = 1
        self._oom_pending = False  # CUDA available but not initialised yet: attach at a later record
        identity = _identity(pp_group, pg_collection)
        self.rank = identity["rank"]
        self.path = os.path.join(self.directory, records.file_name(self.rank))
        self.header = {"format": records.FORMAT, "version": records.VERSION, **identity, "pid": os.getpid(),
                       "started": time.time(), "slots": slots, "slot_bytes": slot_bytes,
                       "liveness_period_s": liveness_period_s}
        if self._open_file():
            _open.add(self)
            _install_exit_hooks()
            self._thread = _Liveness(self)
            self._thread.start()
            self._oom_pending = oom.watch(self, record_history)

    # -- the per-step path -------------------------------------------------------------------

    def record(self, iteration: int, report: dict) -> None:
        """Write a step record: ``report`` (plain numbers) at ``iteration``. One json.dumps and
        one pwrite; no fsync, no collective; never raises."""
        self.iteration = iteration
        if self._oom_pending:
            self._oom_pending = not oom.attach_when_ready()
        if self._fd is not None:
            self._write({"kind": "step", "time": time.time(), "iteration": iteration, "report": report})

    # -- the failure path --------------------------------------------------------------------

    def record_oom(self, fields: dict, report: dict) -> None:
        """Write an ``oom`` record (oom.py calls it from the allocator's observer)."""
        self.oom_count += 1
        if self._fd is not None:
            self._write({"kind": "oom", "time": time.time(), "iteration": self.iteration, "report": report,
                         **fields})

    def end(self, reason: str, detail: str = "") -> None:
        """Write the end marker ``reason`` (one of records.END_REASONS). After "sigterm" the
        recorder stays open (a framework's own handler may let training go on, and a later
        record then says so); any other reason closes it. Never raises."""
        if self._fd is None:
            return
        self.ended = reason
        self._write({"kind": "end", "time": time.time(), "iteration": self.iteration, "report": {},
                     "reason": reason, "detail": detail[:500]})
        if reason != "sigterm":
            self._shut()

    def close(self) -> None:
        """End with reason "close" (when the last user of a shared recorder closes it)."""
        self._users -= 1
        if self._users <= 0:
            self.end("close")

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
            _warn("open", f"cannot write flight records to {self.path} ({error}); training goes on without them "
                  f"(set logger.memory_record_dir to a writable folder, or to 'off')")
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

    def write_liveness(self, liveness: dict) -> None:
        fd = self._fd
        if fd is None:
            return
        try:
            os.pwrite(fd, records.encode(liveness, records.LIVENESS_BYTES), records.HEADER_BYTES)
        except (OSError, records.RecordError) as error:
            self._fail(error)

    def _fail(self, error) -> None:
        _warn("write", f"writing flight records to {self.path} failed ({error}); recording stops, "
              f"training goes on")
        self._shut()

    def _shut(self) -> None:
        fd, self._fd = self._fd, None
        self._stop.set()
        _open.discard(self)
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


def open_recorder(directory, **kwargs) -> FlightRecorder:
    """The recorder for ``directory`` in this process: a new one, or the one already open
    there (shared: each user closes it once, the last close ends it). Logs the folder once."""
    path = os.path.abspath(os.fspath(directory))
    recorder = _by_path.get(path)
    if recorder is not None and recorder._fd is not None:
        recorder._users += 1
        return recorder
    recorder = FlightRecorder(path, **kwargs)
    _by_path[path] = recorder
    if recorder._fd is not None and recorder.rank == 0 and path not in _shown_dirs:
        _shown_dirs.add(path)
        print(f"nemo_memlog: memory flight records in {path} (after a failure: nemo-memlog postmortem {path})",
              file=sys.stderr, flush=True)
    return recorder


def end_all(reason: str, detail: str = "") -> None:
    """Write the end marker ``reason`` in every open recorder of this process. Never raises."""
    for recorder in list(_open):
        try:
            recorder.end(reason, detail)
        except Exception:  # an exit path must not fail
            pass


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
        return records.encode({"seq": obj["seq"], "kind": obj["kind"], "time": obj["time"],
                               "iteration": obj.get("iteration"), "report": {}, "truncated": True}, size)


def _plain(value):
    return value if isinstance(value, (int, float, str, type(None))) else str(value)


def _default_report() -> dict:
    from ..memory import capacity_report, report_memory

    report = report_memory()
    report.update(capacity_report())
    return report


def _identity(pp_group, pg_collection) -> dict:
    """The header's who-am-I: run id, global rank and world size, pp/tp/dp ranks, host."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    try:
        from ..megatron import coordinates

        coords = coordinates(pp_group, pg_collection) if distributed else {"pp": 0, "tp": 0, "dp": 0}
    except Exception:  # the header must not fail for want of a group
        coords = {"pp": 0, "tp": 0, "dp": 0}
    return {"run_id": run_id(), "rank": dist.get_rank() if distributed else int(os.environ.get("RANK", 0)),
            "world_size": dist.get_world_size() if distributed else int(os.environ.get("WORLD_SIZE", 1)),
            "pp_rank": coords["pp"], "tp_rank": coords["tp"], "dp_rank": coords["dp"],
            "host": socket.gethostname()}


def run_id() -> str:
    """The same id on every rank of one run, with no collective: the first rank to ask sets it in
    torch.distributed's default store (an atomic compare_set), every rank reads that value.
    Without a store: TORCHELASTIC_RUN_ID, SLURM's job (and step) id, else the rendezvous
    address with today's date."""
    store = _default_store()
    if store is not None:
        try:
            return store.compare_set(RUN_ID_KEY, "", uuid.uuid4().hex).decode()
        except Exception:  # a store that lacks compare_set, or is gone: the environment's ids below
            pass
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return env["TORCHELASTIC_RUN_ID"]
    if env.get("SLURM_JOB_ID"):
        return env["SLURM_JOB_ID"] + (f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else "")
    if env.get("MASTER_ADDR"):
        return f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '')}@{time.strftime('%Y-%m-%d')}"
    return uuid.uuid4().hex  # a single process: its own run


def _default_store():
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if dist.is_available() and dist.is_initialized():
            return distributed_c10d._get_default_store()
    except Exception:
        pass
    return None


class _Liveness(threading.Thread):
    """Rewrites the recorder's liveness slot every ``liveness_period_s`` until it is shut."""

    def __init__(self, recorder: FlightRecorder):
        super().__init__(name="nemo_memlog-liveness", daemon=True)
        self.recorder = weakref.ref(recorder)
        self.stop = recorder._stop
        self.period = recorder.liveness_period_s
        self.evidence = HostEvidence()

    def run(self) -> None:
        beats = 0
        while True:
            recorder = self.recorder()
            if recorder is None or self.stop.is_set():
                break
            beats += 1
            try:
                recorder.write_liveness({"alive": time.time(), "beats": beats, **self.evidence.read()})
            except Exception:  # never let this thread die noisily; the next beat tries again
                pass
            del recorder
            if self.stop.wait(self.period):
                break


class HostEvidence:
    """The host's side of a death by the kernel's OOM killer: MemAvailable, this process's RSS,
    /proc/vmstat's oom_kill and the job cgroup's oom_kill (cgroup v2 memory.events, or v1
    memory.oom_control), each read through the descriptor memory.py keeps open for it. None
    where the machine lacks one."""

    def __init__(self):
        self.cgroup = _cgroup_events_path()

    def read(self) -> dict:
        return {"host_available_gb": _gb(_field("/proc/meminfo", b"MemAvailable:", 1024)),
                "host_rss_gb": _gb(_field("/proc/self/status", b"VmRSS:", 1024)),
                "vmstat_oom_kill": _field("/proc/vmstat", b"oom_kill "),
                "cgroup_oom_kill": _field(self.cgroup, b"oom_kill ")}


def _field(path: str | None, key: bytes, scale: int = 1):
    """The number after ``key`` at the start of a line of ``path``, times ``scale``; None where
    the file or the line is missing."""
    if path is None:
        return None
    try:
        text = b"\n" + read_proc(path)
        at = text.find(b"\n" + key)
        if at < 0:
            return None
        return int(text[at + 1 + len(key) :].split(None, 1)[0]) * scale
    except (OSError, ValueError, IndexError):
        return None


def _gb(value):
    return None if value is None else value / GB


def _cgroup_events_path(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> str | None:
    """This process's cgroup file that counts OOM kills: v2 ``memory.events``, v1
    ``memory.oom_control``; None where neither is readable."""
    try:
        with open(proc_cgroup) as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return None
    candidates = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":  # v2: "0::/path"
            candidates += [os.path.join(root, path.lstrip("/"), "memory.events"), os.path.join(root, "memory.events")]
        elif "memory" in controllers.split(","):  # v1
            candidates += [os.path.join(root, "memory", path.lstrip("/"), "memory.oom_control"),
                           os.path.join(root, "memory", "memory.oom_control")]
    return next((path for path in candidates if os.access(path, os.R_OK)), None)


# -- exit paths ---------------------------------------------------------------------------------


def _install_exit_hooks() -> None:
    """End markers at interpreter exit ("exit"), on an unhandled exception in the main thread
    ("exception") and on SIGTERM ("sigterm", before the writers drain): process_wide.py."""
    process_wide.on_exit(_end_all_exit)
    process_wide.on_exception(_end_all_exception)
    process_wide.on_sigterm(_end_all_sigterm, first=True)


def _end_all_exit() -> None:
    end_all("exit")


def _end_all_exception(kind, value, traceback) -> None:
    end_all("exception", f"{kind.__name__}: {value}")


def _end_all_sigterm() -> None:
    end_all("sigterm")


_warned: set = set()


def _warn(kind: str, text: str) -> None:
    """Once per kind of failure and process: a failing disk must not flood the training log."""
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"nemo_memlog: {text}", RuntimeWarning, stacklevel=3)
