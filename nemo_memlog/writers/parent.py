"""The writer process, the training process's side: ``ProcessFanOut``.

``ProcessFanOut`` has ThreadFanOut's methods. It starts ``python -m nemo_memlog.writers.child
FD`` (a fresh interpreter: no fork, no user ``__main__``, nothing secret on its command
line) and sends it every message (wire.py) over one AF_UNIX SOCK_SEQPACKET socket pair. That
process runs an ordinary ``ThreadFanOut`` (child.py), so isolation, retries, drop counting
and once-per-kind notices work as in thread mode; its notices come back over the socket and
are said here on the "nemo_memlog" logger, so they reach the user's console and logs as before.

Hand-off. ``log`` pickles the step and sends it with one non-blocking ``send``: a
SEQPACKET message goes into the kernel whole or not at all, so a step is either handed
over (the writer process will read it even if this process is killed the next
instant) or still ours. Only when the socket is full (the writer process is starting or
behind) does it wait in a bounded backlog here (``writer_buffer_steps``; oldest dropped
and counted), which a feeder thread sends as the socket drains; a SIGKILL loses that
backlog. The training thread never waits for the writer process.

Ending. ``close`` (also at interpreter exit and on SIGTERM, through process_wide.py) sends
the close budget, then shuts the socket for writing; a dead training process (SIGKILL,
segfault, ``os._exit``) closes it too: child.py says what the writer process does then. A
forked child of this process (a data-loader worker) lets go of the socket at once, so the
writer process still sees this process's death.

Secrets travel through the socket only. The writer process's environment is this
process's, less every variable whose name looks like a secret or whose value holds a
configured secret (``ps`` and /proc/PID/environ show its exec-time argv and
environment); those variables are sent over the socket and put into its
``os.environ``, where the backends read them, as they would in this process.
"""

from __future__ import annotations

import collections
import itertools
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .. import process_wide
from ..config import secret_name
from ..warn import WarnOnce, notice
from . import wire

if TYPE_CHECKING:
    from ..config import Settings

CHILD_MODULE = "nemo_memlog.writers.child"
SEND_BUFFER = 8 << 20  # asked for; the kernel caps it at net.core.wmem_max (x2)
#: Blocked from the writer process's fork on (a signal mask survives exec), until its main() ignores
#: them: a launcher's teardown signals the whole process group, and one arriving while the writer
#: process's interpreter starts would otherwise end it with every step handed to it.
HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
REPLY_GRACE_S = 2.0  # a reply may take this much longer than the budget it answers for
STATS_WAIT_S = 10.0


def split_environment(environ: Mapping[str, str], secrets: list[str]) -> tuple[dict, dict]:
    """(public, private): private holds every variable whose name looks like a secret or
    whose value contains one of ``secrets``; public the rest."""
    public, private = {}, {}
    for name, value in environ.items():
        secret = secret_name(name) or any(s and s in value for s in secrets)
        (private if secret else public)[name] = value
    return public, private


class ProcessFanOut:
    """The writers, in a writer process: ThreadFanOut's interface. ``pid`` is the writer
    process's. Raises (OSError, ...) when no process can be started here."""

    def __init__(self, settings: Settings, names: list[str], params: dict, secrets: list[str]):
        """The backends ``names`` (of base.CONFIGURED) for ``settings`` (a config.Settings),
        recording ``params``; ``secrets`` are scrubbed from every warning and kept off the
        writer process's command line and environment."""
        self.backend_names = list(names)
        self.close_timeout_s = settings.writer_close_timeout_s
        self.closed = False
        self.dropped = 0  # steps that never reached the writer process
        self._limit = settings.writer_buffer_steps
        self._lock = threading.Lock()
        self._sendable = threading.Condition(self._lock)  # the backlog changed
        self._backlog: collections.deque = collections.deque()  # [chunks, droppable]
        self._backlog_steps = 0
        self._feeder = None
        self._sending_thread = None  # set while a thread is inside the lock (see close)
        self._shut = False  # no more sending: closed, or the writer process is gone
        self._replies: dict = {}
        self._ids = itertools.count()
        self._goodbye = None  # the writer process's final counts
        self._ended = threading.Event()  # goodbye received, or the writer process gone
        self._deadline: float | None = None  # when the close under way must be done (monotonic)
        self._warn_once = WarnOnce(secrets=secrets)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            public, private = split_environment(os.environ, secrets)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)  # this thread's, for the fork
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno())],
                    pass_fds=[theirs.fileno()],
                    env=_with_package_path(public),
                    stdin=subprocess.DEVNULL,
                )
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self.process.pid
        self._sock = ours
        process_wide.on_fork_child(self._forget_after_fork)
        process_wide.on_exit(self.close)
        process_wide.on_sigterm(self.close)
        threading.Thread(target=self._read, name="nemo_memlog-writer-replies", daemon=True).start()
        start = wire.Start(wire.VERSION, settings.to_plain(), self.backend_names, params, secrets, private)
        self._send(start, droppable=False)

    # --- the training thread's side ---
    def log(self, metrics: dict, step: int) -> None:
        """Hand ``metrics`` at ``step`` to the writer process. Never blocks on it, never raises (the main
        thread waits here only for the end of a SIGTERM's close that ends the process: process_wide)."""
        if process_wide.holding:
            process_wide.hold_if_ending()
        self._send(wire.Log(metrics, step), droppable=True)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every backend has written every step handed to it (bounded). True if all did."""
        timeout = self.close_timeout_s if timeout_s is None else timeout_s
        return self._request(lambda ident: wire.Flush(ident, timeout), wait_s=timeout + REPLY_GRACE_S) is True

    def stats(self) -> dict:
        """Per backend: written, pending, dropped, failures; ``dropped`` includes the steps
        that never reached the writer process."""
        counts = self._goodbye if self.closed else self._request(wire.Stats, wait_s=STATS_WAIT_S)
        if counts is None:
            counts = self._goodbye or {}
        zero = {"written": 0, "pending": 0, "dropped": 0, "failures": 0}
        return {
            name: {**zero, **counts.get(name, {}), "dropped": counts.get(name, zero)["dropped"] + self.dropped}
            for name in self.backend_names
        }

    def close(self, timeout_s: float | None = None) -> None:
        """Drain and close every backend within ``timeout_s`` (+ REPLY_GRACE_S), and reap the
        writer process. Idempotent: a second call while the first is under way (a SIGTERM from
        the launcher landing during the close the exit path began) waits for it, within its
        budget, so the signal is handed on only once the backends have stored what they had.
        The hooks stay registered until the close has ended, for that reason."""
        if self.closed:
            self._await_close()
            return
        self.closed = True
        budget = self.close_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        self._deadline = deadline
        try:
            self._close(budget, deadline)
        finally:
            process_wide.forget(self.close)
            process_wide.forget(self._forget_after_fork)

    def _await_close(self) -> None:
        """Wait (until the first close's deadline) for the writer process's goodbye and exit."""
        deadline = self._deadline
        if deadline is None or self._ended.is_set() and self.process.poll() is not None:
            return
        final = deadline + REPLY_GRACE_S
        self._ended.wait(max(0.0, final - time.monotonic()))
        try:
            self.process.wait(max(0.0, final - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass

    def _close(self, budget: float, deadline: float) -> None:
        # A signal handler (SIGTERM) that interrupted this very thread inside _send must not
        # take the lock this thread holds (a deadlock). Ending the stream needs no lock.
        reentered = self._sending_thread == threading.get_ident()
        if not reentered:
            self._send(wire.Close(budget), droppable=False)
            self._wait_for_backlog(deadline)
        self._stop_sending(reentered)
        final = deadline + REPLY_GRACE_S
        self._ended.wait(max(0.0, final - time.monotonic()))
        try:
            self.process.wait(max(0.0, final - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # its watchdog ends it; nothing here waits any longer
        if self._goodbye is None and not self._warn_once.seen("gone"):
            self._warn_once("no-goodbye", f"the writer process did not confirm closing the backends within {budget} s")
        if self.dropped:
            notice(f"nemo_memlog: {self.dropped} logged steps never reached the writer process")
        if not reentered:
            self._release_socket()

    # --- sending: ordered, never blocking the caller ---
    def _send(self, message, droppable: bool) -> bool:
        try:
            chunks = wire.encode(message)
        except Exception as error:  # e.g. a metric value that cannot be pickled: never raise into training
            self._warn_once(
                ("pickle", type(error).__name__),
                f"a step could not be sent to the writer process "
                f"({type(error).__name__}: {error}); such steps are dropped and counted",
            )
            self._lose(droppable)
            return False
        with self._lock:
            self._sending_thread = threading.get_ident()
            try:
                if self._shut:
                    self._lose(droppable)
                    return False
                if not self._backlog and len(chunks) == 1:
                    try:
                        self._sock.send(chunks[0], socket.MSG_DONTWAIT)
                        return True
                    except BlockingIOError:
                        pass
                    except OSError:  # the writer process is gone
                        self._shut = True
                        self._lose(droppable)
                        return False
                self._enqueue(chunks, droppable)
                return True
            finally:
                self._sending_thread = None

    def _enqueue(self, chunks: list[bytes], droppable: bool) -> None:
        if droppable and self._backlog_steps >= self._limit:
            for index, entry in enumerate(self._backlog):
                if entry[1] and entry[2] == 0:  # a step not yet begun: the oldest one
                    del self._backlog[index]
                    self._backlog_steps -= 1
                    self._lose(True)
                    self._warn_once(
                        "full",
                        f"the writer process is behind and {self._limit} steps wait for it; "
                        f"dropping the oldest (raise logger.writer_buffer_steps to keep more)",
                    )
                    break
        self._backlog.append([collections.deque(chunks), droppable, 0])
        self._backlog_steps += droppable
        if self._feeder is None:
            self._feeder = threading.Thread(target=self._feed, name="nemo_memlog-writer-feeder", daemon=True)
            self._feeder.start()
        self._sendable.notify_all()

    def _feed(self) -> None:
        """Send the backlog as the socket drains (a thread of its own: never the caller's)."""
        while True:
            with self._lock:
                while not self._backlog and not self._shut:
                    self._sendable.wait()
                if self._shut:
                    return
            try:
                select.select([], [self._sock], [], 0.2)
            except (OSError, ValueError):  # closed meanwhile: the next round sees _shut
                pass
            with self._lock:
                self._pump()
                self._sendable.notify_all()

    def _pump(self) -> None:
        """Send backlog messages until the socket is full (lock held)."""
        while self._backlog and not self._shut:
            entry = self._backlog[0]
            chunks = entry[0]
            while chunks:
                try:
                    self._sock.send(chunks[0], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                except OSError:
                    self._shut = True
                    self._lose_backlog()
                    return
                chunks.popleft()
                entry[2] += 1
            self._backlog.popleft()
            self._backlog_steps -= entry[1]

    def _wait_for_backlog(self, deadline: float) -> None:
        with self._lock:
            while self._backlog and not self._shut:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._sendable.wait(min(left, 0.2))

    def _stop_sending(self, reentered: bool) -> None:
        """End the stream: the writer process reads what was sent, then sees its end."""
        self._shut = True
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if not reentered:
            with self._lock:
                self._lose_backlog()
                self._sendable.notify_all()  # the feeder ends

    def _lose_backlog(self) -> None:
        for entry in self._backlog:
            self._lose(entry[1])
        self._backlog.clear()
        self._backlog_steps = 0

    def _lose(self, droppable: bool) -> None:
        if droppable:
            self.dropped += 1

    def _release_socket(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reply reader if it still waits
        except OSError:
            pass
        with self._lock:
            self._sock.close()

    # --- replies and warnings from the writer process ---
    def _request(self, message_for, wait_s: float):
        """The value of the Reply to ``message_for(ident)``, or None (no reply within ``wait_s``)."""
        ident = next(self._ids)
        slot = self._replies[ident] = [threading.Event(), None]
        try:
            if self._ended.is_set() or not self._send(message_for(ident), droppable=False):
                return None
            slot[0].wait(wait_s)
            return slot[1]
        finally:
            self._replies.pop(ident, None)

    def _read(self) -> None:
        receiver = wire.Receiver(self._sock)
        while True:
            try:
                message = receiver.receive()
            except OSError:
                message = wire.EOF
            if message is wire.EOF:
                break
            if isinstance(message, wire.Warned):
                notice(message.text)  # the writer process's notice, said here as there
            elif isinstance(message, wire.Reply):
                slot = self._replies.get(message.ident)
                if slot is not None:  # else its caller stopped waiting
                    slot[1] = message.value
                    slot[0].set()
            elif isinstance(message, wire.Goodbye):
                self._goodbye = message.stats
        self._shut = True
        self._ended.set()
        for slot in list(self._replies.values()):
            slot[0].set()
        if not self.closed:
            try:
                code = self.process.wait(5)
            except subprocess.TimeoutExpired:
                code = "unknown"
            self._warn_once(
                "gone", f"the writer process ended unexpectedly (exit code {code}); later steps are dropped and counted"
            )

    def _forget_after_fork(self) -> None:
        """In a forked child of the training process (a data-loader worker, say): let go of
        the socket and send nothing, so the writer process still sees the trainer's death."""
        self.closed = self._shut = True
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._sendable = threading.Condition(self._lock)
        self._ended.set()
        self._sock.close()


def _with_package_path(environ: dict) -> dict:
    """``environ`` with this nemo_memlog's directory first on PYTHONPATH, so the writer
    process runs this very code (a script may have put it on sys.path by hand). Not for
    an installed package: a site-packages directory ahead of the standard library could
    shadow parts of it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.basename(root) in ("site-packages", "dist-packages"):
        return environ
    paths = [root] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return {**environ, "PYTHONPATH": os.pathsep.join(paths)}
