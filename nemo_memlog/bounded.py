"""Reading files other people's jobs wrote, without being hurt by them: regular files only, with a
size cap, and JSON whose nesting depth is not a crash. Records are copied between clusters; a name like a record's
can be a FIFO (reading it waits forever), a symlink to /dev/zero (endless), or a sparse file of a
terabyte. No torch; prints nothing.

``read_regular(path, limit)`` returns the bytes or raises ``Refused`` (a ValueError) saying why the
file was not read; ``load_json`` parses text whose nesting a hostile writer chose.
"""

from __future__ import annotations

import json
import os
import stat


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
