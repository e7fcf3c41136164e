"""Waiting on a condition with a deadline, in place of a sleep that hopes it is long enough.

    wait_for(lambda: path.exists(), 60, "the rank's ready file")
    wait_for(lambda: progress() >= 6, 180, "six finished iterations", proc=torchrun)
    seconds = seconds_until(lambda: not alive(pid), 30, "the writer process's exit")
    said = Lines(proc.stderr)  # read by a thread: wait_for(lambda: "ready" in said.text(), 60, ...)

Stdlib only (and guard.py's /proc reading, stdlib too): rank and child scripts import it too.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..launch.guard import alive, descendants

__all__ = ["Lines", "alive", "descendants", "left_behind", "returns_within", "seconds_until", "wait_for"]

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    proc=None,
    detail: Callable[[], str] | None = None,
    interval_s: float = 0.1,
) -> T:
    """Poll ``predicate()`` until it returns something true, and return that. Fails (AssertionError)
    after ``timeout_s`` seconds, or as soon as ``proc`` (a Popen, if given) has ended first: the
    message names ``what`` was awaited, followed by ``detail()`` (the tail of a log, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = predicate()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (exit status {proc.returncode}) before {what}" + _more(detail))
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s" + _more(detail))
        time.sleep(interval_s)


def seconds_until(predicate: Callable[[], object], timeout_s: float, what: str, **how) -> float:
    """``wait_for``, returning the seconds it waited (for a test to print, never to bound)."""
    began = time.monotonic()
    wait_for(predicate, timeout_s, what, **how)
    return time.monotonic() - began


def returns_within(call: Callable[[], T], timeout_s: float, what: str) -> T:
    """``call()``'s result, run in a daemon thread of its own; fails (AssertionError) if it has not
    returned within ``timeout_s`` seconds: a call that blocks fails the test with ``what`` named,
    instead of hanging it until pytest's timeout. The call's own exception is raised here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as error:  # handed to the caller
            outcome.append((False, error))

    threading.Thread(target=run, name="returns_within", daemon=True).start()
    ((returned, value),) = wait_for(lambda: outcome, timeout_s, what, interval_s=0.01)
    if not returned:
        raise value
    return value


class Lines:
    """The lines of a text stream (a child's pipe), read as they come by a thread of their own, so
    that a test waits on them with ``wait_for`` and a deadline, never in a blocking ``readline``."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def text(self) -> str:
        """What was read so far."""
        return "".join(self.lines)

    def ended(self, timeout_s: float) -> str:
        """Everything, once the stream has ended (the writing process and any that share the pipe
        are gone); fails (AssertionError) after ``timeout_s`` seconds."""
        wait_for(lambda: not self._reader.is_alive(), timeout_s, "the end of the stream", detail=self.text)
        return self.text()


def left_behind(marker: str) -> list[str]:
    """Command lines of the processes still running (zombies not) that mention ``marker`` (a test's
    own folder, say), this process aside: what a test that ends a process tree finds left of it."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and alive(int(entry)):
            try:
                line = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in line:
                found.append(line)
    return found


def _more(detail: Callable[[], str] | None) -> str:
    return "" if detail is None else ":\n" + detail()


def as_at_a_terminal() -> None:
    """A ``preexec_fn``: the child starts with SIGINT at its default, as a command typed at a terminal
    does (Ctrl-C reaches it), whatever this process inherited: a job started with ``&`` by a shell without
    job control (a CI script, ``nohup``) ignores SIGINT, and so would the child, which a test of what
    Ctrl-C does then never sees."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
