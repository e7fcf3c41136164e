"""Fan one metrics dict out to every backend, off the training thread, losing nothing.

Each backend runs as a ``BufferedBackend``: a daemon thread and a bounded buffer of logged
steps. ``ThreadFanOut.log`` appends the (read-only) dict to one queue and wakes one dispatcher
thread, which puts it in every backend's buffer: the training thread never waits on a
backend, and a slow or hung backend never holds up the others.

A backend that writes several steps in one call (``log_steps``, up to its ``batch_metrics``
metrics: MLflow's one ``log_batch``, one transaction) is handed what its buffer holds, oldest first,
as one batch: a backlog (a store that opened late, a slow server) is caught up in a call per batch,
not per step. A backend call that fails leaves its step (or batch) at the head of that backend's buffer and is
retried with backoff (0.5 s doubling to 30 s), so a backend that comes back gets every
step it missed, in order. A failure no retry can cure (an unwritable or missing folder:
base.PERMANENT_ERRNOS) stops that backend at once, said once; a full disk is said once, in
those words, and retried. At close a backend still failing gets CLOSE_ATTEMPTS more tries,
not the whole budget, and each backend that did not store every step says how many it missed.
When a buffer is full (``writer_buffer_steps``), the OLDEST
step of that backend (other than one being written) is dropped, counted, and warned
about once: the training thread never blocks, and memory stays bounded. ``close`` tells every
backend's thread at once to write what it holds and then end its store, each on its own: a slow
or hung backend (a server that never answers, a store still opening) holds up no other
backend's end. That matters most at a launcher's teardown, whose SIGKILL follows its SIGTERM
by a fixed grace (30 s for torchrun, SLURM and Kubernetes): W&B's run and Comet's offline
archive are only complete once ended, so each ends as soon as its own steps are written, and a
store that needs its end to keep them (a backend's ``end_reserve_s``) stops writing that long
before the close budget runs out, so that the end still fits in it.
Failures are said once per backend and kind of failure (notices on the "nemo_memlog" logger,
warn.py), with secrets scrubbed from the message.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import process_wide
from ..warn import WarnOnce, notice
from .base import DISK_FULL_ERRNOS, PERMANENT_ERRNOS, backend_module, os_errno

if TYPE_CHECKING:
    from ..config import Settings
    from .base import Backend

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
#: Failed attempts during a close's drain after which a failing backend is given up on: the
#: exit is never held up for the whole close budget by a backend that cannot write.
CLOSE_ATTEMPTS = 3
#: At most this long, in time whatever the tries, does a backend that is failing when the close
#: begins (a full disk, a hung server) hold the close: draining and closing it together. A healthy
#: backend gets the whole close budget (writer_close_timeout_s).
FAILING_CLOSE_S = 4.0
MAX_LOST_RANGES = 20  # step ranges kept per backend for the summary (the rest merged into the last)


def step_ranges(ranges: list) -> str:
    """ "steps 3-7, 9" for [[3, 7], [9, 9]]."""
    return "steps " + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


class BufferedBackend:
    """One backend behind a buffer and a thread. ``opener()`` builds the backend (in the thread)."""

    def __init__(self, name: str, opener: Callable[[], Backend], buffer_steps: int, secrets: list[str]):
        self.name = name
        self._opener = opener
        self._backend = None
        self._buffer: collections.deque = collections.deque()
        self._limit = buffer_steps
        self._cond = threading.Condition()
        self._in_flight = 0  # how many of the buffer's first items are being written now (a batch: several)
        self._closing = False
        self._close_by: float | None = None  # the close's deadline, handed to the backend's close
        self._close_began: float | None = None  # when the close was asked for (the budget's start)
        self._close_failures = 0  # failed attempts since the close began (CLOSE_ATTEMPTS)
        self._reported = False  # close() reported what was not stored
        self._counted = False  # close() counted the steps still buffered as lost
        self._warn_once = WarnOnce(f"{name} backend: ", secrets)
        self.written = 0
        self.dropped = 0
        self.failures = 0
        self._failing = False  # set by a failure, cleared (with a message) by the next success
        self._stopped = False  # a permanent failure (an unwritable folder): nothing more is tried
        self.reason = ""  # why steps were not stored, for the summary at close
        self.lost_steps: list[list] = []  # [first, last] ranges of the steps never stored
        self._thread = threading.Thread(target=self._run, name=f"nemo_memlog-{name}", daemon=True)
        self._thread.start()

    # --- training thread side ---
    def put(self, metrics: dict, step: int) -> None:
        with self._cond:
            if self._stopped:
                self._lose([step])
                return
            in_flight = self._in_flight  # the steps being written are kept: they end written
            if len(self._buffer) >= self._limit and len(self._buffer) > in_flight:
                self._lose([self._buffer[in_flight][1]])
                del self._buffer[in_flight]
                self._warn_once(
                    "full",
                    f"its buffer of {self._limit} steps is full (the backend is failing or too slow); "
                    f"dropping the oldest steps (raise logger.writer_buffer_steps to keep more)",
                )
            self._buffer.append((metrics, step))
            self._cond.notify()

    def close_deadline(self, deadline: float) -> float:
        """``deadline``, or sooner for a backend failing now (FAILING_CLOSE_S from now)."""
        if self._failing or self._stopped:
            return min(deadline, time.monotonic() + FAILING_CLOSE_S)
        return deadline

    def drain(self, deadline: float) -> bool:
        """Wait until every buffered step is written, or the deadline. True if drained."""
        with self._cond:
            failures = self.failures
            while self._buffer or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or self.failures - failures >= CLOSE_ATTEMPTS:
                    return False
                self._cond.notify_all()  # a flush cuts the retry backoff short
                self._cond.wait(min(left, 0.05))
            return True

    def request_close(self, deadline: float | None = None) -> None:
        """Stop taking steps: the thread writes what it holds (CLOSE_ATTEMPTS tries at most for a
        failing backend; none begun within the backend's ``end_reserve_s`` of ``deadline``), then
        ends the backend's store by ``deadline``, on its own, whatever the other backends' threads do."""
        with self._cond:
            if self._close_by is None and deadline is not None:
                self._close_by, self._close_began = deadline, time.monotonic()
            self._closing = True
            self._cond.notify_all()

    def _writes_end(self) -> float | None:
        """At close, when no write may start: the deadline, less what the backend keeps to end its
        store (``end_reserve_s``: W&B's finish, Comet's archive; at most half the budget). A store
        that keeps each step as it is written (TensorBoard, MLflow) writes until the deadline."""
        if self._close_by is None or self._close_began is None:
            return None
        reserve = getattr(self._backend, "end_reserve_s", 0.0)
        return self._close_by - min(reserve, (self._close_by - self._close_began) / 2)

    def close(self, deadline: float) -> None:
        """``request_close(deadline)``, and wait for the backend's end until ``deadline``. What was
        not stored is reported by the first call that gets through its report: one interrupted in
        its report by a signal whose handler closes again (a launcher's SIGTERM) is reported by that
        call, which may be the last this process runs (the handler then ends it), so a report is
        marked done only once said (said twice, at worst, where the interrupted call resumes)."""
        self.request_close(deadline)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._reported:
            return
        if self._thread.is_alive():
            self._warn_once("close", "did not finish closing in time (logger.writer_close_timeout_s)")
        if self._buffer and not self._counted:
            self._counted = True  # the steps still buffered are counted as lost once
            self._warn_once("unwritten", f"{len(self._buffer)} steps were still unwritten at close")
            self._lose([step for _, step in self._buffer])
        if self.dropped:
            why = f" ({self.reason})" if self.reason else ""
            notice(
                f"nemo_memlog: {self.name} did not store {self.dropped} of the {self.written + self.dropped} "
                f"logged steps{why}: {step_ranges(self.lost_steps)}"
            )
        self._reported = True

    def _lose(self, steps: list) -> None:
        """Count ``steps`` as never stored, and remember which (as ranges: bounded however many)."""
        self.dropped += len(steps)
        for step in steps:
            ranges = self.lost_steps
            if ranges and ranges[-1][1] + 1 == step:
                ranges[-1][1] = step
            elif len(ranges) < MAX_LOST_RANGES:
                ranges.append([step, step])
            else:
                ranges[-1][1] = max(ranges[-1][1], step)  # the tail merged: a bounded list, a wider last range

    def flush_backend(self) -> None:
        with self._cond:
            backend = self._backend
        if backend is not None:
            self._call("flush", backend.flush)

    # --- writer thread side ---
    def _run(self) -> None:
        delay = RETRY_FIRST_S
        while True:
            with self._cond:
                while not self._buffer and not self._closing:
                    self._cond.wait()
                if not self._buffer or self._past(self._writes_end()):
                    break  # closing, and drained or out of time to write: end the store now
                batch = self._batch()
                self._in_flight = len(batch)
            written = self._write(batch)
            with self._cond:
                self._in_flight = 0
                if written:
                    for metrics, step in batch[:written]:  # each still at the head (a drop never takes one in flight)
                        if self._buffer and self._buffer[0][1] == step and self._buffer[0][0] is metrics:
                            self._buffer.popleft()
                    delay = RETRY_FIRST_S
                    self._cond.notify_all()
                    continue
                if self._stopped:  # a permanent failure: what is buffered will never be stored
                    self._lose([step for _, step in self._buffer])
                    self._buffer.clear()
                    self._cond.notify_all()
                    break
                if self._closing:
                    self._close_failures += 1
                    writes_end = self._writes_end()
                    if self._close_failures >= CLOSE_ATTEMPTS or self._past(writes_end):
                        break  # given up on: what it holds is counted at close
                    self._cond.wait(min(delay, max(0.0, (writes_end or 0) - time.monotonic())))
                else:
                    self._cond.wait(delay)  # back off; a drain() or the close wakes us early to retry now
                delay = min(delay * 2, RETRY_MAX_S)
        if self._backend is not None:
            self._call("close", self._backend.close, self._close_by)

    @staticmethod
    def _past(moment: float | None) -> bool:
        return moment is not None and time.monotonic() >= moment

    def _batch(self) -> list[tuple[dict, int]]:
        """The buffer's first step, and after it (a backend with ``log_steps``) the steps that follow while
        their metrics together stay within its ``batch_metrics``. Called holding the lock."""
        limit = getattr(self._backend, "batch_metrics", 0) if hasattr(self._backend, "log_steps") else 0
        batch, count = [self._buffer[0]], len(self._buffer[0][0])
        for item in itertools.islice(self._buffer, 1, None):
            count += len(item[0])
            if count > limit:
                break
            batch.append(item)
        return batch

    def _write(self, batch: list[tuple[dict, int]]) -> int:
        """How many of ``batch`` (the buffer's first steps) were written: all, or 0 (a failure)."""
        if self._backend is None:
            opened, self._backend = self._call("open", self._opener)
            if not opened:
                return 0
            process_wide.exit_first()  # our close before the exit hooks its library just registered
            batch = batch[:1]  # opened just now: from the next write on, batches are sized by the backend
        if len(batch) == 1:
            ok = self._call("log", self._backend.log, *batch[0])[0]
        else:
            ok = self._call("log", self._backend.log_steps, batch)[0]
        if not ok:
            return 0
        self.written += len(batch)
        if self._failing:
            notice(
                f"nemo_memlog: {self.name} is writing again after {self.failures} failed attempts; "
                f"buffered steps are being replayed"
            )
            self._failing = False
        return len(batch)

    def _call(self, what: str, fn, *args) -> tuple[bool, object]:
        """(succeeded, what ``fn`` returned); a failure is counted and warned once per kind."""
        try:
            return True, fn(*args)
        except Exception as error:  # isolation: a backend never raises into training
            self.failures += 1
            self._failing = True
            code = os_errno(error)
            if what in ("open", "log") and code in PERMANENT_ERRNOS:
                self._stopped = True
                self.reason = f"{what} failed: {error}"
                self._warn_once(
                    "stopped",
                    f"{what} failed with {type(error).__name__}: {error}; a retry cannot cure this, so this backend "
                    f"stops: the steps it holds and every later one are not stored (the other backends go on)",
                )
            elif what in ("open", "log") and code in DISK_FULL_ERRNOS:
                self.reason = "its disk is full"
                self._warn_once(
                    "disk full",
                    f"{what} failed: the disk holding its folder is full ({error}); steps stay buffered and are "
                    f"retried with backoff (free space, or point its folder elsewhere); what is still unstored at the "
                    f"end is counted then",
                )
            else:
                self._warn_once(
                    (what, type(error).__name__),
                    f"{what} failed with {type(error).__name__}: {error}; "
                    + ("retrying with backoff, steps stay buffered" if what in ("open", "log") else "ignored"),
                )
            return False, None

    def stats(self) -> dict:
        with self._cond:
            return {
                "written": self.written,
                "pending": len(self._buffer),
                "dropped": self.dropped,
                "failures": self.failures,
            }


class ThreadFanOut:
    """The writers, in threads of this process: one ``log(metrics, step)`` to every
    ``BufferedBackend``. Also the no-op writers when there are none.

    ``log`` wakes ONE dispatcher thread, which hands the step to every backend: the training
    thread pays one lock and one wake-up per step, however many backends there are.
    """

    def __init__(
        self, buffered: list[BufferedBackend], close_timeout_s: float = 30.0, *, closes_with_process: bool = True
    ):
        """``closes_with_process``: closed at interpreter exit and on SIGTERM (process_wide.py);
        False in the writer process, which decides its own end."""
        self.buffered = buffered
        self.backend_names = [backend.name for backend in buffered]
        self.close_timeout_s = close_timeout_s
        self.closed = False
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._moving = False
        self._stopping = False
        self._deadline: float | None = None  # the first close's (a second one works to it)
        self._ended = False  # the first close returned
        if buffered:
            threading.Thread(target=self._dispatch, name="nemo_memlog-fanout", daemon=True).start()
        if buffered and closes_with_process:
            process_wide.on_exit(self.close)
            process_wide.on_sigterm(self.close)

    def log(self, metrics: dict, step: int) -> None:
        """Hand ``metrics`` (not copied: callers must not mutate it afterwards) to every backend. (The main
        thread waits here only for the end of a SIGTERM's close that ends the process: process_wide.)"""
        if process_wide.holding:  # a step handed once the close began would never be written
            process_wide.hold_if_ending()
        if self.buffered:
            with self._cond:
                self._queue.append((metrics, step))
                self._cond.notify()

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                steps = list(self._queue)
                self._queue.clear()
                self._moving = True
            for metrics, step in steps:
                for backend in self.buffered:
                    backend.put(metrics, step)
            with self._cond:
                self._moving = False
                self._cond.notify_all()

    def _handed_off(self, deadline: float) -> bool:
        """Wait until the dispatcher has given every logged step to the backends."""
        with self._cond:
            while self._queue or self._moving:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every backend has written every step handed to it (bounded). True if all did."""
        deadline = time.monotonic() + (self.close_timeout_s if timeout_s is None else timeout_s)
        drained = self._handed_off(deadline) and all([backend.drain(deadline) for backend in self.buffered])
        for backend in self.buffered:
            backend.flush_backend()
        return drained

    def close(self, timeout_s: float | None = None) -> None:
        """Drain and close every backend within ``timeout_s`` in total. Idempotent: a second call
        while the first is under way (a launcher's SIGTERM landing during the close the exit path
        began, in this very thread or another) does the same draining within the first call's
        deadline, so the signal is handed on only once the backends have stored what they hold.
        The hooks stay registered until the close has ended, for that reason."""
        if self.closed:
            if self._deadline is not None and not self._ended:
                self._close_by(self._deadline)
            return
        self.closed = True
        self._deadline = time.monotonic() + (self.close_timeout_s if timeout_s is None else timeout_s)
        try:
            self._close_by(self._deadline)
        finally:
            self._ended = True
            process_wide.forget(self.close)

    def _close_by(self, deadline: float) -> None:
        """Hand every step to the backends, drain them and close them by ``deadline``; every part may
        run twice (a re-entered close), the backends' close reports once."""
        self._handed_off(deadline)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        # Every backend told at once to write what it holds and end its store: a slow or hung one
        # delays no other's end, and one failing as the close begins holds it FAILING_CLOSE_S at most.
        deadlines = [backend.close_deadline(deadline) for backend in self.buffered]
        for backend, by in zip(self.buffered, deadlines):
            backend.request_close(by)
        for backend, by in zip(self.buffered, deadlines):
            backend.close(by)

    def stats(self) -> dict:
        """Per backend: written, pending, dropped, failures (after the pending hand-off)."""
        self._handed_off(time.monotonic() + 5)
        return {backend.name: backend.stats() for backend in self.buffered}


def open_thread_fanout(
    settings: Settings, names: list[str], params: dict, secrets: list[str], *, closes_with_process: bool = True
) -> ThreadFanOut:
    """The backends ``names`` (of base.CONFIGURED), each opened lazily in a thread of this
    process behind its own buffer of ``settings.writer_buffer_steps``."""
    buffered = [
        BufferedBackend(name, _opener(name, settings, params, secrets), settings.writer_buffer_steps, secrets)
        for name in names
    ]
    return ThreadFanOut(buffered, settings.writer_close_timeout_s, closes_with_process=closes_with_process)


def _opener(name: str, settings, params: dict, secrets: list[str]):
    return lambda: backend_module(name).open_backend(settings, params, secrets)
