"""Waiting on a condition with a deadline, in place of a sleep that hopes it is long enough.

    wait_for(lambda: path.exists(), 60, "the rank's ready file")
    wait_for(lambda: progress() >= 6, 180, "six finished iterations", proc=torchrun)

Stdlib only (and guard.py's /proc reading, stdlib too): rank and child scripts import it too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..offline.guard import alive, descendants

__all__ = ["alive", "descendants", "left_behind", "wait_for"]

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
