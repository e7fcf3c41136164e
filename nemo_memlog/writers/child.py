"""The writer process, its own side: ``python -m nemo_memlog.writers.child FD``.

Started by parent.py's ``ProcessFanOut``, with its end of the socket as file descriptor FD.
It reads a ``wire.Start`` (refused unless its version is wire.VERSION), puts the private
environment it carries into ``os.environ``, rebuilds the Settings (``config.from_plain``)
and runs an ordinary ``ThreadFanOut`` over the backends named, then serves Log, Flush,
Stats and Close until the stream ends.

Ending. After a Close, or when the training process's end of the socket closes (the
trainer died: SIGKILL, segfault, ``os._exit``), it closes every backend within the budget
(``writer_close_timeout_s`` when the trainer died), says Goodbye with its final counts, and
exits at once (``os._exit``: the backends are closed, and an interpreter's teardown of their
modules, atexit hooks included, took seconds of a loaded machine's CPU). The kernel ends it
EXIT_GRACE_S after the budget whatever a backend does (an alarm, SIGALRM at its default
action: no thread of ours need run, nor the GIL be free, for it to act), so it never outlives
its job. It also polls its parent, in case a forked child of the trainer still holds the socket.
It ignores SIGINT and SIGTERM, which a terminal or a scheduler sends to the whole process group,
from its fork on (held blocked until its main() ignores them):
the trainer's own handler (process_wide.py) or its death decides when the writer process closes. It runs at nice +10.

Notices. Ours (the "nemo_memlog" logger's records) go back to the training process as
``wire.Warned``, to be said there on its own "nemo_memlog" logger; once the trainer is gone,
to this process's stderr, which is the training process's. Other warnings go to that stderr.

Imports only config, wire and fanout (and the backends fanout opens), never the package's
``writers/__init__``'s factories.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ..config import from_plain
from . import wire
from .fanout import open_thread_fanout

PARENT_POLL_S = 0.5
EXIT_GRACE_S = 0.5
WRITER_NICE = 10  # when CPU is short, training goes first; an idle core still runs the writer at full speed


class Link:
    """Messages to the training process, from any thread; False once it is gone."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._lock = threading.Lock()
        self.open = True

    def send(self, message: object) -> bool:
        with self._lock:
            if not self.open:
                return False
            try:
                for chunk in wire.encode(message):  # one chunk: replies and warnings are small
                    self.sock.sendall(chunk)
                return True
            except TimeoutError:  # the training process is not reading (stopped?): this one is not sent
                return False
            except OSError:
                self.open = False
                return False


def messages(sock: socket.socket, parent: int) -> Iterator[Any]:
    """The training process's messages, until its end of the socket closes or it dies."""
    receiver = wire.Receiver(sock)
    sock.settimeout(PARENT_POLL_S)
    while True:
        try:
            message = receiver.receive()
        except TimeoutError:
            if os.getppid() == parent:
                continue
            sock.setblocking(False)  # the trainer died, yet a fork of it holds the socket: take what is there
            try:
                while (message := receiver.receive()) is not wire.EOF:
                    yield message
            except OSError:
                pass
            return
        except OSError:
            return
        if message is wire.EOF:
            return
        yield message


class Forward(logging.Handler):
    """Our notices to the training process (said there); to this process's stderr once it is gone."""

    def __init__(self, link: Link):
        super().__init__(logging.WARNING)
        self.link = link

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()[:8192]
            if not self.link.send(wire.Warned(record.levelname, text)):
                sys.stderr.write(text + "\n")
        except Exception:  # noqa: S110 -- a notice that cannot be said is not worth failing a write for
            pass


def forward_notices(link: Link) -> None:
    """Every record of the "nemo_memlog" logger goes to the training process, whose logging
    configuration decides where it shows; none is printed here as well."""
    logger = logging.getLogger("nemo_memlog")
    logger.addHandler(Forward(link))
    logger.propagate = False


def serve(sock: socket.socket, parent: int) -> None:
    """Run the backends for the training process on the other end of ``sock``."""
    link = Link(sock)
    stream = messages(sock, parent)
    try:
        start = next(stream, None)
    except Exception:  # a Start this version cannot even unpickle: another nemo_memlog sent it
        return
    if not isinstance(start, wire.Start) or start.version != wire.VERSION:
        return
    os.environ.update(start.private_environ)
    forward_notices(link)
    settings = from_plain(start.settings)
    fanout = open_thread_fanout(settings, start.backend_names, start.params, start.secrets, closes_with_process=False)
    budget = settings.writer_close_timeout_s
    for message in stream:
        if isinstance(message, wire.Log):
            fanout.log(message.metrics, message.step)
        elif isinstance(message, wire.Flush):
            link.send(wire.Reply(message.ident, fanout.flush(message.timeout_s)))
        elif isinstance(message, wire.Stats):
            link.send(wire.Reply(message.ident, fanout.stats()))
        elif isinstance(message, wire.Close):
            budget = message.budget_s
            break
    end_by_alarm(budget + EXIT_GRACE_S)
    fanout.close(budget)
    link.send(wire.Goodbye(fanout.stats()))


def end_by_alarm(seconds: float) -> None:
    """The kernel ends this process ``seconds`` from now (SIGALRM, its default action: terminate)."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))


def main(argv: list[str]) -> int:
    try:
        os.nice(WRITER_NICE)
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Blocked since the fork (parent.HELD_SIGNALS): one that came meanwhile is pending, now ignored.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    serve(socket.socket(fileno=int(argv[1])), os.getppid())
    return 0


def exit_now(status: int) -> None:
    """Flush what was said, then end without the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: S110 -- a closed stream: nothing to flush
            pass
    os._exit(status)


if __name__ == "__main__":
    exit_now(main(sys.argv))
