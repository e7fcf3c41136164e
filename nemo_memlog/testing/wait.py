"""Waiting on a condition with a deadline, in place of a sleep that hopes it is long enough.

    wait_for(lambda: path.exists(), 60, "the rank's ready file")
    wait_for(lambda: progress() >= 6, 180, "six finished iterations", proc=torchrun)

Stdlib only: rank and child scripts import it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

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


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _more(detail: Callable[[], str] | None) -> str:
    return "" if detail is None else ":\n" + detail()
