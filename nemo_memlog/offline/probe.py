"""One probe of ``nemo-memlog fit``: the user's command launched at one micro-batch size, watched
until every rank has recorded two measured logging steps, then ended as a launcher ends a job.
No torch: processes, signals and the per-layer records only.

The probe learns where to write through ``NEMO_MEMLOG_PROBE_DIR`` (config.schema.PROBE_DIR_ENV),
which the product reads wherever it resolves its record folder, so every way in works unchanged.
The command starts in a session of its own; this process makes itself the child subreaper
(Linux's PR_SET_CHILD_SUBREAPER), so that a worker whose launcher died (torchrun starts each worker
in its own session) is re-parented here, not to init, and is found and ended with the others:
SIGTERM to every descendant's process group, SIGKILL after ``grace_s``, every one reaped. Should
fit itself be killed outright, the kernel sends the probe's first process SIGTERM
(PR_SET_PDEATHSIG), and its launcher ends its workers.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..measure import layer_record

#: The environment variable the product reads (config.schema.PROBE_DIR_ENV; not imported: no torch here).
PROBE_DIR_ENV = "NEMO_MEMLOG_PROBE_DIR"
#: Measured logging steps every rank records before a probe is ended: the first may precede the
#: optimizer's state (Adam's moments appear at the first step), the second is a steady iteration.
STEPS = 2
POLL_S = 0.2
LOG_NAME = "probe.log"
#: A line of the command's output that says why it ended: an exception, an OOM, a kill.
_ERROR = re.compile(r"\w*(Error|Exception)\b|[Oo]ut of memory|OOM|Killed|SIGKILL")


@dataclass
class Probe:
    """What one launch at ``micro_batch_size`` gave: ``status`` "measured" (every rank recorded
    STEPS measured steps), "died" (the command ended first, ``exit_code`` not 0), "ended" (it ended
    with 0 before that) or "timeout"; the folder of its records and its output (``LOG_NAME``)."""

    micro_batch_size: int
    folder: Path
    status: str = ""
    exit_code: int | None = None
    seconds: float = 0.0
    ranks_recorded: int = 0
    world_size: int | None = None
    notes: list[str] = field(default_factory=list)
    output_tail: str = ""  # the command's last lines, where it died or ended on its own

    def read_tail(self, lines: int = 12) -> str:
        """The last ``lines`` of the command's output (LOG_NAME), after the last line that names an
        error (a launcher's summary often follows the cause), or ""."""
        try:
            text = (self.folder / LOG_NAME).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [line for line in text if _ERROR.search(line)]
        tail = text[-lines:]
        return "\n".join(([errors[-1]] if errors and errors[-1] not in tail else []) + tail)

    @property
    def measured(self) -> bool:
        return self.status == "measured"


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux); whether it could."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _end_with_parent() -> None:
    """In the probe's first process, before it runs the command: SIGTERM it when fit dies (even by
    SIGKILL), so that its launcher ends its workers as on any SIGTERM (Linux's PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_probe(command: list[str], size: int, folder: Path, timeout_s: float, grace_s: float) -> Probe:
    """Launch ``command`` (the size already in it) with its records going to ``folder``; return when
    every rank has recorded STEPS measured logging steps, or the command ended, or ``timeout_s``
    passed, with every process it started ended (also when this raises: KeyboardInterrupt)."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = Probe(size, folder)
    started = time.monotonic()
    with open(folder / LOG_NAME, "wb") as log:
        proc = subprocess.Popen(
            command,
            env={**os.environ, PROBE_DIR_ENV: str(folder)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_end_with_parent,
        )
        try:
            _watch(proc, probe, started + timeout_s)
        finally:
            end_tree(proc, grace_s)
    probe.seconds = time.monotonic() - started
    if probe.status in ("died", "ended", "timeout"):  # kept: the folder may be a temporary one
        probe.output_tail = probe.read_tail()
    return probe


def _watch(proc: subprocess.Popen, probe: Probe, deadline: float) -> None:
    while True:
        if _recorded(probe):
            probe.status = "measured"
            return
        code = proc.poll()
        if code is not None:
            probe.exit_code = code
            probe.status = "measured" if _recorded(probe) else ("ended" if code == 0 else "died")
            return
        if time.monotonic() > deadline:
            probe.status = "timeout"
            return
        time.sleep(POLL_S)


def _recorded(probe: Probe) -> bool:
    """Whether every rank's record in the probe's folder has STEPS measured steps (counts noted)."""
    steps: dict[int, int] = {}
    for path in probe.folder.iterdir():
        rank = layer_record.rank_of(path.name)
        record = layer_record.read_rank(probe.folder, rank) if rank is not None else None
        if record is None:  # another file, or one that cannot be read (yet): counted at a later poll
            continue
        probe.world_size = record.get("world_size") or probe.world_size
        steps[int(record["rank"])] = int(record.get("measured_steps") or 0)
    probe.ranks_recorded = sum(1 for count in steps.values() if count >= STEPS)
    return probe.world_size is not None and probe.ranks_recorded >= probe.world_size


# ---- ending every process a probe started ------------------------------------------------------


def descendants(root: int = 0) -> list[int]:
    """The processes below ``root`` (0: this process), from /proc's parent links."""
    root = root or os.getpid()
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_all(signum: int, pids: list[int]) -> None:
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    groups.discard(os.getpgrp())  # never this process's own group
    for group in groups:
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:  # one that left its group
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _reap() -> None:
    """Collect every ended child of this process (re-parented orphans included), without waiting."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_tree(proc: subprocess.Popen, grace_s: float) -> None:
    """End ``proc`` and everything below it (and any orphan re-parented here): SIGTERM to each one's
    process group, as torchrun, SLURM or Kubernetes would; SIGKILL to what is left after ``grace_s``;
    each reaped. Returns when none is left."""
    pids = [proc.pid, *descendants(proc.pid), *(pid for pid in descendants() if pid != proc.pid)]
    if proc.poll() is None or len(pids) > 1:
        _signal_all(signal.SIGTERM, pids)
    deadline = time.monotonic() + grace_s
    while True:
        proc.poll()
        _reap()
        alive = [pid for pid in descendants() if not _zombie(pid)]
        if not alive:
            break
        if time.monotonic() > deadline:
            _signal_all(signal.SIGKILL, alive)
            deadline = time.monotonic() + 30.0
        time.sleep(0.05)
    proc.poll()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
