"""The host memory limit that binds this process: its memory cgroup's, as clusters enforce it.

SLURM (``ConstrainRAMSpace``), Kubernetes and ``docker run --memory`` put a job in a memory
cgroup; the kernel's OOM killer fires at that cgroup's limit, while ``/proc/meminfo`` still
shows the whole node. So the distance to a SIGKILL is the smaller of MemAvailable and the
limit minus what the cgroup holding the limit uses.

- cgroup v2: ``memory.max`` of this process's cgroup and of each ancestor up to the mount
  (``max``: none); the smallest binds, with that cgroup's ``memory.current``.
- cgroup v1: ``memory.limit_in_bytes`` of the memory cgroup and its ancestors, with that
  cgroup's ``memory.usage_in_bytes``; and ``hierarchical_memory_limit`` in the own cgroup's
  ``memory.stat`` (the kernel's minimum over ancestors this process may not see, in a container).
- A limit at or above the machine's RAM (v1's "unlimited" is about 2**63) is no limit.

``find_limit`` walks the tree once per process; ``Limit.read`` re-reads the two files
through descriptors kept open (``process_wide.read_proc``): microseconds a logging step. A file
that cannot be read means no limit, silently: a machine without cgroups is the common case.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from .process_wide import read_proc


@dataclass(frozen=True)
class Limit:
    """The binding limit: the file holding it, and the usage file of the same cgroup."""

    limit_path: str
    usage_path: str
    version: int  # 1 or 2
    stat_key: bytes | None = None  # v1 memory.stat's hierarchical_memory_limit: read that line

    def read(self) -> tuple[int, int] | None:
        """(limit, usage) in bytes now; None where a file cannot be read or parsed."""
        try:
            limit = _number(read_proc(self.limit_path), self.stat_key)
            usage = _number(read_proc(self.usage_path), None)
        except (OSError, ValueError):
            return None
        if limit is None or usage is None:
            return None
        return limit, usage


def find_limit(
    host_bytes: int,
    proc_cgroup: str = "/proc/self/cgroup",
    mountinfo: str = "/proc/self/mountinfo",
) -> Limit | None:
    """The limit binding this process, below ``host_bytes`` (the machine's RAM); None without one.
    ``proc_cgroup`` and ``mountinfo`` are the files the kernel shows (a test points them at a fake tree)."""
    try:
        with open(proc_cgroup) as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
        mounts = _cgroup_mounts(mountinfo)
    except OSError:
        return None
    found = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "" and "v2" in mounts:
            found += _candidates(mounts["v2"], path, 2, host_bytes)
        elif "memory" in controllers.split(",") and "v1" in mounts:
            found += _candidates(mounts["v1"], path, 1, host_bytes)
    return min(found, key=lambda pair: pair[0])[1] if found else None


@lru_cache(maxsize=4)
def limit_of_process(pid: int, host_bytes: int) -> Limit | None:
    """``find_limit`` once per process (``pid``: a forked child looks again)."""
    return find_limit(host_bytes)


def _cgroup_mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """{"v1": (mount point, mount root), "v2": (...)}: the memory v1 hierarchy and the v2 one."""
    mounts = {}
    with open(mountinfo) as lines:
        for line in lines:
            fields = line.split()
            if " - " not in line or len(fields) < 5:
                continue
            after = line.split(" - ", 1)[1].split()
            fstype, options = after[0], after[2] if len(after) > 2 else ""
            if fstype == "cgroup2":
                mounts.setdefault("v2", (fields[4], fields[3]))
            elif fstype == "cgroup" and "memory" in options.split(","):
                mounts.setdefault("v1", (fields[4], fields[3]))
    return mounts


def _candidates(mount: tuple[str, str], path: str, version: int, host_bytes: int) -> list[tuple[int, Limit]]:
    """(limit, Limit) for each cgroup from this process's up to the mount that has a limit below the RAM."""
    point, root = mount
    relative = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
    parts = [] if relative in (".", "") else relative.strip("/").split("/")
    limit_name, usage_name = (
        ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    found = []
    for depth in range(len(parts), -1, -1):
        folder = os.path.join(point, *parts[:depth])
        limit = Limit(os.path.join(folder, limit_name), os.path.join(folder, usage_name), version)
        value = limit.read()
        if value is not None and 0 < value[0] < host_bytes:
            found.append((value[0], limit))
        if version == 1 and depth == len(parts):
            stat = Limit(os.path.join(folder, "memory.stat"), limit.usage_path, 1, b"hierarchical_memory_limit")
            value = stat.read()
            if value is not None and 0 < value[0] < host_bytes:
                found.append((value[0], stat))
    return found


def _number(text: bytes, key: bytes | None) -> int | None:
    """The file's number ("max": None), or the number after ``key`` at a line's start."""
    if key is not None:
        at = (b"\n" + text).find(b"\n" + key + b" ")
        if at < 0:
            return None
        text = text[at + len(key) + 1 :].split(b"\n", 1)[0]
    text = text.strip()
    if text == b"max":
        return None
    return int(text)
