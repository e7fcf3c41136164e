"""Reading files other people's jobs wrote, without being hurt by them: regular files only, with a
size cap, and JSON whose nesting depth is not a crash. Records are copied between clusters; a name like a record's
can be a FIFO (reading it waits forever), a symlink to /dev/zero (endless), or a sparse file of a
terabyte. No torch; prints nothing.

``read_regular(path, limit)`` returns the bytes or raises ``Refused`` (a ValueError) saying why the
file was not read; ``load_json`` parses text whose nesting a hostile writer chose; ``ReadBudget``
caps what one command reads of a run's files together, and says how far a long read is.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Sequence


class Refused(ValueError):
    """A file that is not read: not a regular file, or larger than anything we write."""


def file_kind(mode: int) -> str | None:
    """None for a regular file, else what it is in words."""
    if stat.S_ISREG(mode):
        return None
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole of the regular file at ``path`` (a symlink to one is read) in one read system call.
    Raises Refused for a FIFO, device, socket or directory (never opened for a blocking read) and for a
    file over ``limit`` bytes (a sparse file included); OSError as the system says."""
    kind = file_kind(os.stat(path).st_mode)
    if kind is not None:
        raise Refused(f"{kind}, not a regular file: not read")
    # O_NONBLOCK: should the file be swapped for a FIFO since the stat, opening it does not wait.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        kind = file_kind(info.st_mode)
        if kind is not None:
            raise Refused(f"{kind}, not a regular file: not read")
        if info.st_size > limit:
            raise Refused(f"{info.st_size} bytes, more than the {limit} such a file can be: not read")
        data = os.read(fd, info.st_size + 1)  # one byte more: a file still growing past the cap is seen
    finally:
        os.close(fd)
    if len(data) > limit:
        raise Refused(f"more than the {limit} bytes such a file can be: not read")
    return data


def load_json(text: str | bytes) -> object:
    """``json.loads``, a nesting depth bomb a ValueError like any other bad JSON (not a RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


#: What one command reads of a run's record files together (the per-layer records, the flight records):
#: thousands of ranks' records are a few hundred MB; four files at the per-file cap took 37 s and 808 MB.
RUN_READ_BYTES = 256 << 20
#: A read that has taken this long says how far it is, and again as often.
PROGRESS_EVERY_S = 2.0


class ReadBudget:
    """One cap on the bytes a command reads of a run's files together, taken from their sizes before
    any is read (a refusal costs a ``stat`` per file), and progress on a read that takes seconds.

    ``reserve(paths, what, file_limit)`` raises Refused when the files, with those reserved before, hold more
    than ``limit``; ``read_one()`` after each file says how far the read is (``say``: a line, at most
    every PROGRESS_EVERY_S once the read has taken that long; None: nothing said)."""

    def __init__(self, limit: int = RUN_READ_BYTES, say: Callable[[str], None] | None = None):
        self.limit, self.say, self.used = limit, say, 0
        self.what, self.count, self.done = "", 0, 0
        self.started = self.said = time.monotonic()

    def reserve(self, paths: Sequence[str | os.PathLike[str]], what: str, file_limit: int) -> None:
        """Reserve the reads of ``paths``; a file over ``file_limit`` (each one's own cap) costs nothing:
        read_regular refuses it unread, and its reader names it."""
        sizes = [(_size_of(path), path) for path in paths]
        sizes = sorted(((size if size <= file_limit else 0, path) for size, path in sizes), key=lambda item: -item[0])
        total = sum(size for size, _ in sizes)
        if self.used + total > self.limit:
            largest = ", ".join(f"{os.fspath(path)} ({size / 1e6:.0f} MB)" for size, path in sizes[:3])
            before = f" after {self.used / 1e6:.0f} MB of other files" if self.used else ""
            raise Refused(
                f"{len(sizes)} {what} hold {total / 1e6:.0f} MB together{before}, more than the "
                f"{self.limit / 1e6:.0f} MB read of one run (the largest: {largest}): not read; point at one "
                "run's folder, or move the files no run of this job wrote"
            )
        self.used += total
        self.what, self.count, self.done = what, len(sizes), 0

    def read_one(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.say is not None and now - self.said >= PROGRESS_EVERY_S:
            self.said = now
            self.say(f"reading {self.what}: {self.done} of {self.count} files, {now - self.started:.0f} s")


def _size_of(path: str | os.PathLike[str]) -> int:
    """The size a read of ``path`` would take: a regular file's (a symlink followed); 0 for anything
    read_regular refuses unread (a FIFO, a device) or that cannot be seen."""
    try:
        info = os.stat(path)
    except OSError:
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0
