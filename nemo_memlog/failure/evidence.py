"""The host's side of a death by the kernel's OOM killer, as the liveness beat records it.

A rank killed by the OOM killer (SIGKILL) writes nothing more; what the post-mortem can show
is what the host looked like up to then: MemAvailable, the memory cgroup's limit and usage
(rank/host_limit.py: SLURM, Kubernetes, containers), this process's RSS, /proc/vmstat's
``oom_kill`` and the job cgroup's ``oom_kill`` (cgroup v2 ``memory.events``, or v1
``memory.oom_control``). Each file is re-read through a descriptor kept open
(``process_wide.proc_field``): the beat costs microseconds and never allocates a descriptor.
"""

from __future__ import annotations

import os

from ..keys import HOST_AVAILABLE, HOST_LIMIT, HOST_LIMIT_USED, HOST_RSS
from ..process_wide import proc_field
from ..rank.host_limit import limit_of_process
from ..rank.memory import host_total_bytes

GB = 1e9


class HostEvidence:
    """``read()``: the liveness slot's evidence fields (records.py), None where the machine
    lacks one. The OOM-kill counter's file is found once, at construction; the memory limit is
    re-read at each beat (``host_limit.ProcessLimit``: one set or changed mid-run counts from
    the next beat on). Never raises."""

    def __init__(self):
        self.cgroup = cgroup_events_path()
        self.limit = limit_of_process(os.getpid(), host_total_bytes())

    def read(self) -> dict:
        limit = None if self.limit is None else self.limit.read()
        return {
            HOST_LIMIT.key: None if limit is None else limit[0] / GB,
            HOST_LIMIT_USED.key: None if limit is None else limit[1] / GB,
            HOST_AVAILABLE.key: _gb(proc_field("/proc/meminfo", b"MemAvailable:", 1024)),
            HOST_RSS.key: _gb(proc_field("/proc/self/status", b"VmRSS:", 1024)),
            "vmstat_oom_kill": proc_field("/proc/vmstat", b"oom_kill "),
            "cgroup_oom_kill": proc_field(self.cgroup, b"oom_kill "),
        }


def cgroup_events_path(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> str | None:
    """This process's cgroup file that counts OOM kills: v2 ``memory.events``, v1
    ``memory.oom_control``; None where neither is readable. ``proc_cgroup`` and ``root`` are
    the files the kernel shows (a test points them at a fake tree)."""
    try:
        with open(proc_cgroup) as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return None
    candidates = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":  # v2: "0::/path"
            candidates += [os.path.join(root, path.lstrip("/"), "memory.events"), os.path.join(root, "memory.events")]
        elif "memory" in controllers.split(","):  # v1
            candidates += [
                os.path.join(root, "memory", path.lstrip("/"), "memory.oom_control"),
                os.path.join(root, "memory", "memory.oom_control"),
            ]
    return next((path for path in candidates if os.access(path, os.R_OK)), None)


def _gb(value):
    return None if value is None else value / GB
