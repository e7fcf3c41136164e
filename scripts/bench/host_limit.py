"""Part 7: what issue 25 adds per logging step and per memory phase (this process).

- The memory cgroup limit: ``capacity_report`` as a logging step runs it, with the limit read
  (two preads through kept-open descriptors) and without, interleaved; and ``Limit.read`` alone,
  on this process's own memory cgroup files; and ``ProcessLimit.read``, the limit followed as each
  logging step now reads it (the cgroup chain's files re-read, so a limit set or changed mid-run is seen).
- ``memory_phase``: an empty ``with memory_phase("bench"):`` (enter and leave: two reads and
  resets of the peak counters, the flight records of this process, none here), against
  ``report_memory`` for scale, interleaved.
"""

from __future__ import annotations

import os

from bench.timing import interleaved, summarise


def _own_limit():
    """A Limit over this process's own memory cgroup files, unlimited or not: the reads are the same."""
    from nemo_memlog.rank.host_limit import Limit

    for line in open("/proc/self/cgroup"):
        _, controllers, path = line.rstrip("\n").split(":", 2)
        if "memory" in controllers.split(","):
            folder = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
            return Limit(
                os.path.join(folder, "memory.limit_in_bytes"), os.path.join(folder, "memory.usage_in_bytes"), 1
            )
        if controllers == "" and os.path.exists(os.path.join("/sys/fs/cgroup", path.lstrip("/"), "memory.current")):
            folder = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            return Limit(os.path.join(folder, "memory.current"), os.path.join(folder, "memory.current"), 2)
    return None


def host_limit_part(repetitions: int) -> dict:
    from nemo_memlog.measure.phase import memory_phase, take_pending
    from nemo_memlog.rank import memory

    limit = _own_limit()
    found = memory.host_limit_bytes

    def without_limit(_):
        memory.host_limit_bytes = lambda: None  # the path of a machine without a limit
        try:
            memory.capacity_report()
        finally:
            memory.host_limit_bytes = found

    def with_limit(_):
        memory.host_limit_bytes = limit.read  # the path of a job under a limit: two preads
        try:
            memory.capacity_report()
        finally:
            memory.host_limit_bytes = found

    def phase(_):
        with memory_phase("bench"):
            pass

    variants = {"report_memory": lambda _: memory.report_memory(), "phase": phase}
    if limit is not None:
        variants |= {"capacity": without_limit, "capacity_limit": with_limit, "limit_read": lambda _: limit.read()}
    from nemo_memlog.rank.host_limit import ProcessLimit

    followed = ProcessLimit(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    variants["limit_followed"] = lambda _: followed.read()  # what a logging step now does: the chain re-read
    wall, _ = interleaved(variants, repetitions, warmup=50)
    take_pending()
    memory.reset_peaks()
    return {"limit_found": limit is not None, **summarise(wall)}


def host_limit_markdown(part: dict | None) -> list[str]:
    if not part:
        return []
    lines = ["", "Host limit and memory phases (this process), us per call, median (p90), interleaved:", ""]
    lines += ["| | median | p90 |", "|---|---:|---:|"]
    names = {
        "capacity": "capacity_report, no limit",
        "capacity_limit": "capacity_report, reading a cgroup limit and usage",
        "limit_read": "Limit.read alone (two preads)",
        "limit_followed": "ProcessLimit.read: the limit followed, as each logging step reads it (the chain re-read)",
        "phase": "an empty memory_phase (enter + leave)",
        "report_memory": "report_memory (for scale)",
    }
    for key, label in names.items():
        if key in part:
            lines.append(f"| {label} | {part[key]['median_us']:.1f} | {part[key]['p90_us']:.1f} |")
    return lines
