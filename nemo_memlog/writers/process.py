"""The writer process: the backends run in a process of their own, fed through a socket.

``ProcessFanOut`` (in the training process) has FanOut's methods. It starts
``python -m nemo_memlog.writers.process FD`` (a fresh interpreter: no fork, no user
``__main__``, nothing secret on its command line) and sends it every message over one
AF_UNIX SOCK_SEQPACKET socket pair. That process runs an ordinary ``FanOut`` (a thread
and a bounded, retrying buffer per backend), so isolation, retries, drop counting and
once-per-kind warnings work as in thread mode; its warnings come back over the socket
and are re-raised here, so they reach the user's console, filters and logs as before.

Hand-off. ``log`` pickles the step and sends it with one non-blocking ``send``: a
SEQPACKET message goes into the kernel whole or not at all, so a step is either handed
over (the writer process will read it even if this process is killed the next
instant) or still ours. Only when the socket is full (the writer process is starting or
behind) does it wait in a bounded backlog here (``writer_buffer_steps``; oldest dropped
and counted), which a feeder thread sends as the socket drains; a SIGKILL loses that
backlog. The training thread never waits for the writer process.

Ending. ``close`` sends the close budget, then shuts the socket for writing; a dead
training process (SIGKILL, segfault, ``os._exit``) closes it too. Either way the
writer process reads what is left, closes every backend within the budget
(``writer_close_timeout_s`` when the trainer died), says goodbye with its final
counts, and exits; a watchdog ends it half a second after the budget whatever a
backend does, so it never outlives its job. It also polls its parent, in case a forked
child of the trainer still holds the socket. It ignores SIGINT and SIGTERM, which a
terminal or a scheduler sends to the whole process group: the trainer's own handler
(process_wide.py) or its death decides when the writer process closes. It runs at nice +10.

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
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import warnings
import weakref

from .. import process_wide
from ..config import SECRET_NAME, plain_settings, scrubbed, setting

CHILD_MODULE = "nemo_memlog.writers.process"
CHUNK = 32 * 1024  # bytes of pickle per socket message; a larger message is sent in several
_MORE, _LAST = b"\x01", b"\x00"
SEND_BUFFER = 8 << 20  # asked for; the kernel caps it at net.core.wmem_max (x2)
REPLY_GRACE_S = 2.0  # a reply may take this much longer than the budget it answers for
STATS_WAIT_S = 10.0
PARENT_POLL_S = 0.5
EXIT_GRACE_S = 0.5
WRITER_NICE = 10  # when CPU is short, training goes first; an idle core still runs the writer at full speed
_EOF = object()
_live: "weakref.WeakSet[ProcessFanOut]" = weakref.WeakSet()


def encode(message) -> list[bytes]:
    """``message`` pickled, as socket messages of at most CHUNK + 1 bytes (a flag byte each)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) <= CHUNK:
        return [_LAST + data]
    parts = [data[start:start + CHUNK] for start in range(0, len(data), CHUNK)]
    return [_MORE + part for part in parts[:-1]] + [_LAST + parts[-1]]


class Receiver:
    """Whole messages from a SEQPACKET socket: ``receive()`` returns one, or _EOF."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._parts: list[bytes] = []

    def receive(self):
        while True:
            chunk = self.sock.recv(CHUNK + 1)  # raises socket.timeout / BlockingIOError as the socket is set
            if not chunk:
                return _EOF
            self._parts.append(chunk[1:])
            if chunk[:1] == _LAST:
                data, self._parts = b"".join(self._parts), []
                return pickle.loads(data)


def split_environment(environ, secrets: list[str]) -> tuple[dict, dict]:
    """(public, private): private holds every variable whose name looks like a secret or
    whose value contains one of ``secrets``; public the rest."""
    public, private = {}, {}
    for name, value in environ.items():
        secret = SECRET_NAME.search(name) or any(s and s in value for s in secrets)
        (private if secret else public)[name] = value
    return public, private


# --------------------------------------------------------------------------------------------
# The training process's side.


class ProcessFanOut:
    """FanOut's interface, with the backends in a writer process. ``sinks`` are the backend
    names (truthy when any writer is configured); ``pid`` is the writer process's."""

    def __init__(self, logger, names: list[str], params: dict, secrets: list[str]):
        self.sinks = list(names)
        self.close_timeout_s = setting(logger, "writer_close_timeout_s")
        self.closed = False
        self.dropped = 0  # steps that never reached the writer process
        self._limit = setting(logger, "writer_buffer_steps")
        self._secrets = secrets
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
        self._warned: set = set()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            public, private = split_environment(os.environ, secrets)
            self.process = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                env=_with_package_path(public), stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self.process.pid
        self._sock = ours
        _live.add(self)
        threading.Thread(target=self._read, name="nemo_memlog-writer-replies", daemon=True).start()
        self._send(("start", plain_settings(logger), self.sinks, params, secrets, private), droppable=False)

    # --- the training thread's side ---
    def log(self, metrics: dict, step: int) -> None:
        """Hand ``metrics`` at ``step`` to the writer process. Never blocks on it, never raises."""
        self._send(("log", metrics, step), droppable=True)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every backend has written every step handed to it (bounded). True if all did."""
        timeout = self.close_timeout_s if timeout_s is None else timeout_s
        return self._request("flush", timeout, wait_s=timeout + REPLY_GRACE_S) is True

    def stats(self) -> dict:
        """Per backend: written, pending, dropped, failures; ``dropped`` includes the steps
        that never reached the writer process."""
        counts = self._goodbye if self.closed else self._request("stats", wait_s=STATS_WAIT_S)
        if counts is None:
            counts = self._goodbye or {}
        zero = {"written": 0, "pending": 0, "dropped": 0, "failures": 0}
        return {name: {**zero, **counts.get(name, {}), "dropped": counts.get(name, zero)["dropped"] + self.dropped}
                for name in self.sinks}

    def close(self, timeout_s: float | None = None) -> None:
        """Drain and close every backend within ``timeout_s`` (+ REPLY_GRACE_S), and reap the
        writer process. Idempotent."""
        if self.closed:
            return
        self.closed = True
        budget = self.close_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        # A signal handler (SIGTERM) that interrupted this very thread inside _send must not
        # take the lock this thread holds (a deadlock). Ending the stream needs no lock.
        reentered = self._sending_thread == threading.get_ident()
        if not reentered:
            self._send(("close", budget), droppable=False)
            self._wait_for_backlog(deadline)
        self._stop_sending(reentered)
        final = deadline + REPLY_GRACE_S
        self._ended.wait(max(0.0, final - time.monotonic()))
        try:
            self.process.wait(max(0.0, final - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # its watchdog ends it; nothing here waits any longer
        if self._goodbye is None and "gone" not in self._warned:
            self._warn_once("no-goodbye", f"the writer process did not confirm closing the backends within {budget} s")
        if self.dropped:
            warnings.warn(f"nemo_memlog: {self.dropped} logged steps never reached the writer process", RuntimeWarning)
        if not reentered:
            self._release_socket()

    # --- sending: ordered, never blocking the caller ---
    def _send(self, message, droppable: bool) -> bool:
        try:
            chunks = encode(message)
        except Exception as error:  # e.g. a metric value that cannot be pickled: never raise into training
            self._warn_once(("pickle", type(error).__name__), f"a step could not be sent to the writer process "
                            f"({type(error).__name__}: {error}); such steps are dropped and counted")
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
                    self._warn_once("full", f"the writer process is behind and {self._limit} steps wait for it; "
                                    f"dropping the oldest (raise logger.writer_buffer_steps to keep more)")
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
    def _request(self, kind: str, *args, wait_s: float):
        ident = next(self._ids)
        slot = self._replies[ident] = [threading.Event(), None]
        try:
            if self._ended.is_set() or not self._send((kind, ident, *args), droppable=False):
                return None
            slot[0].wait(wait_s)
            return slot[1]
        finally:
            self._replies.pop(ident, None)

    def _read(self) -> None:
        receiver = Receiver(self._sock)
        while True:
            try:
                message = receiver.receive()
            except OSError:
                message = _EOF
            if message is _EOF:
                break
            kind = message[0]
            if kind == "warning":
                warnings.warn(message[2], _warning_category(message[1]), stacklevel=1)
            elif kind == "reply":
                slot = self._replies.get(message[1])
                if slot is not None:  # else its caller stopped waiting
                    slot[1] = message[2]
                    slot[0].set()
            elif kind == "goodbye":
                self._goodbye = message[1]
        self._shut = True
        self._ended.set()
        for slot in list(self._replies.values()):
            slot[0].set()
        if not self.closed:
            try:
                code = self.process.wait(5)
            except subprocess.TimeoutExpired:
                code = "unknown"
            self._warn_once("gone", f"the writer process ended unexpectedly (exit code {code}); "
                            f"later steps are dropped and counted")

    def _warn_once(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"nemo_memlog: {scrubbed(text, self._secrets)}", RuntimeWarning, stacklevel=3)

    def _forget(self) -> None:
        """In a forked child of the training process: let go of the socket, send nothing."""
        self.closed = self._shut = True
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._sendable = threading.Condition(self._lock)
        self._ended.set()
        self._sock.close()


def _warning_category(name: str):
    import builtins

    category = getattr(builtins, name, None)
    return category if isinstance(category, type) and issubclass(category, Warning) else RuntimeWarning


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


def _after_fork_in_child() -> None:
    # A fork of the training process (a data-loader worker, say) must not keep the
    # writer process's socket open: the writer process would miss the trainer's death.
    for fanout in list(_live):
        fanout._forget()


process_wide.on_fork_child(_after_fork_in_child)


# --------------------------------------------------------------------------------------------
# The writer process's side.


class _Link:
    """Messages to the training process, from any thread; False once it is gone."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._lock = threading.Lock()
        self.open = True

    def send(self, message) -> bool:
        with self._lock:
            if not self.open:
                return False
            try:
                for chunk in encode(message):  # one chunk: replies and warnings are small
                    self.sock.sendall(chunk)
                return True
            except socket.timeout:  # the training process is not reading (stopped?): this one is not sent
                return False
            except OSError:
                self.open = False
                return False


def _messages(sock: socket.socket, parent: int):
    """The training process's messages, until its end of the socket closes or it dies."""
    receiver = Receiver(sock)
    sock.settimeout(PARENT_POLL_S)
    while True:
        try:
            message = receiver.receive()
        except socket.timeout:
            if os.getppid() == parent:
                continue
            sock.setblocking(False)  # the trainer died, yet a fork of it holds the socket: take what is there
            try:
                while (message := receiver.receive()) is not _EOF:
                    yield message
            except OSError:
                pass
            return
        except OSError:
            return
        if message is _EOF:
            return
        yield message


def _forward_warnings(link: _Link) -> None:
    """Our warnings go to the training process (re-raised there); others, or any once it is
    gone, to this process's stderr, which is the training process's."""
    show = warnings.showwarning

    def forward(message, category, filename, lineno, file=None, line=None):
        text = str(message)[:8192]
        if not (text.startswith("nemo_memlog") and link.send(("warning", category.__name__, text))):
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = forward
    warnings.filterwarnings("always", message="nemo_memlog")  # the training process's filters decide


def serve(sock: socket.socket, parent: int) -> None:
    """Run the backends for the training process on the other end of ``sock``."""
    from . import thread_fanout

    link = _Link(sock)
    messages = _messages(sock, parent)
    start = next(messages, None)
    if start is None or start[0] != "start":
        return
    _, fields, names, params, secrets, private_environ = start
    os.environ.update(private_environ)
    _forward_warnings(link)
    fanout = thread_fanout(types.SimpleNamespace(**fields), names, params, secrets)
    budget = fields["writer_close_timeout_s"]
    for message in messages:
        kind = message[0]
        if kind == "log":
            fanout.log(message[1], message[2])
        elif kind == "flush":
            link.send(("reply", message[1], fanout.flush(message[2])))
        elif kind == "stats":
            link.send(("reply", message[1], fanout.stats()))
        elif kind == "close":
            budget = message[1]
            break
    watchdog = threading.Timer(budget + EXIT_GRACE_S, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    fanout.close(budget)
    link.send(("goodbye", fanout.stats()))


def main(argv: list[str]) -> int:
    try:
        os.nice(WRITER_NICE)
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    serve(socket.socket(fileno=int(argv[1])), os.getppid())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
