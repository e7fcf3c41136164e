"""Real memory cgroups for tests: a child of this process's own memory cgroup, with a limit.

    ok, why = available()
    with memory_cgroup(3_000_000_000) as group:
        group.add(pid)          # the kernel now charges that process here, and OOM-kills at the limit
        group.usage_bytes()

cgroup v1 (``/sys/fs/cgroup/memory``, as on this project's machines) and v2 (``memory.max``).
Needs root (or a delegated cgroup). On leaving, live processes are moved back to the parent
and the folder is removed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from pathlib import Path


def _own_memory_cgroup() -> tuple[Path, int] | None:
    """(this process's memory cgroup folder, cgroup version), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (folder / "memory.limit_in_bytes").exists():
                return folder, 1
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (folder / "cgroup.controllers").exists() and "memory" in (folder / "cgroup.controllers").read_text():
                return folder, 2
    return None


def available() -> tuple[bool, str]:
    """(True, "") where a child memory cgroup can be made here; else (False, why)."""
    own = _own_memory_cgroup()
    if own is None:
        return False, "no memory cgroup controller for this process (/proc/self/cgroup)"
    folder, _ = own
    if not os.access(folder, os.W_OK):
        return False, f"cannot create a cgroup under {folder} (needs root or a delegated cgroup)"
    return True, ""


class MemoryCgroup:
    def __init__(self, path: Path, version: int, parent: Path):
        self.path, self.version, self.parent = path, version, parent

    def add(self, pid: int) -> None:
        """Move ``pid`` into this cgroup (its memory is charged here from now on)."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def usage_bytes(self) -> int:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer ended in this cgroup."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process still in this cgroup, as SLURM ends a job step's (or Kubernetes a
        container's) when its launcher has exited; returns their pids."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        return pids

    def popen(self, command: list[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(command, **kwargs)``, its child inside this cgroup from its first instruction."""
        return subprocess.Popen(command, preexec_fn=self._joiner(), **kwargs)

    def run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run(command, **kwargs)`` with the child inside this cgroup from its first
        instruction (it joins before exec): every process it starts (torchrun's ranks) is too."""
        return subprocess.run(command, preexec_fn=self._joiner(), **kwargs)

    def _joiner(self):
        """A preexec_fn that moves the child into this cgroup before it execs."""
        procs = str(self.path / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as out:
                out.write(str(os.getpid()))

        return join


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A fresh child memory cgroup limited to ``limit_bytes`` (swap included on v1 where it can be
    set, so the limit is one the OOM killer enforces); removed on leaving."""
    own = _own_memory_cgroup()
    if own is None:
        raise RuntimeError(available()[1])
    parent, version = own
    path = parent / f"nemo_memlog-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    group = MemoryCgroup(path, version, parent)
    try:
        if version == 1:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):  # no swap accounting: the plain limit is all there is
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        else:
            (path / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
        yield group
    finally:
        for pid in group.pids():
            with contextlib.suppress(OSError):
                (parent / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            path.rmdir()
