"""The host memory limit that binds this process: its memory cgroup's, as clusters enforce it.

SLURM (``ConstrainRAMSpace``), Kubernetes and ``docker run --memory`` put a job in a memory
cgroup; the kernel's OOM killer fires at that cgroup's limit, while ``/proc/meminfo`` still
shows the whole node. So the distance to a SIGKILL is the smaller of MemAvailable and the
limit minus what the cgroup holding the limit uses.

- cgroup v2: ``memory.max`` of this process's cgroup and of each ancestor up to the mount
  (``max``: none); the smallest binds, with that cgroup's ``memory.current``.
- cgroup v1: ``hierarchical_memory_limit`` in the own cgroup's ``memory.stat``, the kernel's
  minimum over all ancestors, those a container cannot see (or a cgroup namespace hides) too;
  without one below the RAM that one file says there is no limit. With one, the cgroup holding
  it is the one whose ``memory.limit_in_bytes`` (own or an ancestor's in sight) equals it, with
  its ``memory.usage_in_bytes``; none in sight: the own cgroup's usage.
- A limit at or above the machine's RAM (v1's "unlimited" is about 2**63) is no limit.

A limit is set or changed while a job runs (Kubernetes resizes a pod in place; a harness
limits a job it started), so it is followed, not found once: ``limit_of_process`` gives the
process's ``ProcessLimit``, whose ``read`` re-reads, at each logging step, the limit files of
the chain and the binding cgroup's usage, through descriptors kept open
(``process_wide.read_proc``): a few microseconds. The chain (which files) is found again only
when ``/proc/self/cgroup`` changes (the process moved to another cgroup). A file that cannot be
read means no limit, silently: a machine without cgroups is the common case.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from ..process_wide import read_proc


@dataclass(frozen=True)
class Limit:
    """One cgroup's limit: the file holding it, and the usage file of the same cgroup."""

    limit_path: str
    usage_path: str
    version: int  # 1 or 2
    stat_key: bytes | None = None  # v1 memory.stat's hierarchical_memory_limit: read that line

    def limit_bytes(self) -> int | None:
        """The limit now (None: "max", or the key absent). Raises OSError or ValueError."""
        return _number(read_proc(self.limit_path), self.stat_key)

    def read(self) -> tuple[int, int] | None:
        """(limit, usage) in bytes now; None where a file cannot be read or parsed."""
        try:
            limit = self.limit_bytes()
            usage = _number(read_proc(self.usage_path), None)
        except (OSError, ValueError):
            return None
        if limit is None or usage is None:
            return None
        return limit, usage

    @property
    def folder(self) -> str:
        """The cgroup whose usage this limit is judged against (its folder)."""
        return os.path.dirname(self.usage_path)

    def peak_bytes(self) -> int | None:
        """The cgroup's own peak charge since it was made (v1 ``memory.max_usage_in_bytes``, v2
        ``memory.peak``, kernel 5.19+): the kernel's count, shared pages once; None where absent."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return _number(read_proc(os.path.join(self.folder, name)), None)
        except (OSError, ValueError):
            return None


@dataclass(frozen=True)
class Chain:
    """The files that may hold a limit on this process: each cgroup's in sight, deepest first; v1's
    ``memory.stat`` (``summary``), the minimum over them all and those out of sight; the RAM
    (``host_bytes``) a limit must be below to count. Reads only; never raises."""

    limits: tuple[Limit, ...]
    host_bytes: int
    summary: Limit | None = None

    def binding(self) -> tuple[int, Limit] | None:
        """(limit bytes, its Limit) of the smallest limit below the RAM now; None without one.
        One pread a file (v1 without a limit: the summary's alone); on a tie the deepest cgroup
        in sight binds, the summary last."""
        summary = None if self.summary is None else self._below_ram(self.summary)
        if summary == 0:
            return None
        best = None
        for limit in self.limits:
            value = self._below_ram(limit)
            if value and (best is None or value < best[0]):
                best = (value, limit)
        if summary and (best is None or summary < best[0]):
            best = (summary, self.summary)
        return best

    def _below_ram(self, limit: Limit) -> int | None:
        """The limit in bytes; 0 where it is none below the RAM; None where unreadable."""
        try:
            value = limit.limit_bytes()
        except (OSError, ValueError):
            return None
        return value if value is not None and 0 < value < self.host_bytes else 0

    def read(self) -> tuple[int, int] | None:
        """(limit, usage) of the binding cgroup now, in bytes; None without a limit."""
        best = self.binding()
        if best is None:
            return None
        try:
            usage = _number(read_proc(best[1].usage_path), None)
        except (OSError, ValueError):
            return None
        return None if usage is None else (best[0], usage)


class ProcessLimit:
    """This process's limit, followed: ``read()`` re-reads the chain's files each call, and finds
    the chain again when ``proc_cgroup`` (the process's cgroup paths) changes. The descriptors
    of a chain left behind stay open (a few, once per move): closing them could race a reader on
    another thread (the liveness beat). Never raises."""

    def __init__(
        self, host_bytes: int, proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
    ):
        self.host_bytes, self.proc_cgroup, self.mountinfo = host_bytes, proc_cgroup, mountinfo
        self.state: tuple[bytes, Chain | None] | None = None  # one attribute: threads swap it whole

    def read(self) -> tuple[int, int] | None:
        """(limit, usage) in bytes now; None without a limit below the RAM."""
        try:
            cgroups = read_proc(self.proc_cgroup)
        except OSError:
            return None
        state = self.state
        if state is None or state[0] != cgroups:
            state = self.state = (cgroups, _chain(cgroups.decode(), self.mountinfo, self.host_bytes))
        return None if state[1] is None else state[1].read()

    def binding(self) -> Limit | None:
        """The Limit binding now (after a ``read``, which finds the chain); None without one."""
        state = self.state
        best = None if state is None or state[1] is None else state[1].binding()
        return None if best is None else best[1]


def find_chain(
    host_bytes: int, proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> Chain | None:
    """The files that may hold a limit on the process ``proc_cgroup`` describes; None where it or
    the mounts cannot be read. ``proc_cgroup`` and ``mountinfo`` are the files the kernel shows
    (a test points them at a fake tree)."""
    try:
        with open(proc_cgroup) as lines:
            return _chain(lines.read(), mountinfo, host_bytes)
    except OSError:
        return None


def find_limit(
    host_bytes: int,
    proc_cgroup: str = "/proc/self/cgroup",
    mountinfo: str = "/proc/self/mountinfo",
) -> Limit | None:
    """The limit binding now, below ``host_bytes`` (the machine's RAM); None without one."""
    chain = find_chain(host_bytes, proc_cgroup, mountinfo)
    best = None if chain is None else chain.binding()
    return None if best is None else best[1]


@lru_cache(maxsize=4)
def limit_of_process(pid: int, host_bytes: int) -> ProcessLimit | None:
    """This process's ``ProcessLimit`` (``pid``: a forked child gets its own); None where no
    memory cgroup hierarchy is mounted, so a machine without cgroups reads nothing a step."""
    try:
        mounts = _cgroup_mounts("/proc/self/mountinfo")
    except OSError:
        return None
    return ProcessLimit(host_bytes) if mounts else None


def _chain(cgroups: str, mountinfo: str, host_bytes: int) -> Chain | None:
    """The chain for the text of a /proc/<pid>/cgroup file; None where the mounts cannot be read."""
    try:
        mounts = _cgroup_mounts(mountinfo)
    except OSError:
        return None
    limits: list[Limit] = []
    summary = None
    for line in cgroups.splitlines():
        entry = line.split(":", 2)
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "" and "v2" in mounts:
            limits += _levels(mounts["v2"], path, 2)
        elif "memory" in controllers.split(",") and "v1" in mounts:
            levels = _levels(mounts["v1"], path, 1)
            own = _own_folder(mounts["v1"], path)
            usage = os.path.join(own, "memory.usage_in_bytes")
            summary = Limit(os.path.join(own, "memory.stat"), usage, 1, b"hierarchical_memory_limit")
            limits += levels
    if summary is not None and any(limit.version == 2 for limit in limits):
        limits.append(summary)  # both hierarchies limit (a hybrid host): the summary gates neither
        summary = None
    return Chain(tuple(limits), host_bytes, summary)


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


def _parts(mount: tuple[str, str], path: str) -> list[str]:
    """The folders from the mount down to the cgroup ``path`` (as /proc/<pid>/cgroup names it)."""
    root = mount[1]
    relative = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
    return [] if relative in (".", "") else relative.strip("/").split("/")


def _own_folder(mount: tuple[str, str], path: str) -> str:
    return os.path.join(mount[0], *_parts(mount, path))


def _levels(mount: tuple[str, str], path: str, version: int) -> list[Limit]:
    """A Limit for each cgroup from this process's up to the mount whose limit file opens
    (v2's root has none: it is left out, and costs nothing a step)."""
    parts = _parts(mount, path)
    limit_name, usage_name = (
        ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    levels = []
    for depth in range(len(parts), -1, -1):
        folder = os.path.join(mount[0], *parts[:depth])
        limit = Limit(os.path.join(folder, limit_name), os.path.join(folder, usage_name), version)
        try:
            read_proc(limit.limit_path)  # opens the descriptor each step re-reads
        except OSError:
            continue
        levels.append(limit)
    return levels


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
