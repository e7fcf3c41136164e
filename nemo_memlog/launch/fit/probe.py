"""One probe of ``nemo-memlog fit``: the user's command launched at one micro-batch size, watched
until every rank's peak has stopped rising (``steady``: STEADY_STEPS measured logging steps after the
first within STEADY of each other), at most MAX_STEPS measured steps, then ended as a
launcher ends a job. No torch: processes, signals and the per-layer records only.

The probe learns where to write through ``NEMO_MEMLOG_PROBE_DIR`` (config.schema.PROBE_DIR_ENV),
which the product reads wherever it resolves its record folder, so every way in works unchanged.
The command runs under a guard (guard.py), a small process between fit and the command that
outlives fit: the child subreaper of the command's every process (torchrun starts each worker in
a session of its own; a daemon may double-fork), it ends them all when fit asks or when fit's end
of a pipe closes (fit exited, even by SIGKILL): SIGTERM to every one and its process group, SIGKILL
after ``grace_s``, every one reaped.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ... import advice
from ...keys import PEAK_RESERVED
from ...measure import layer_record
from ...offline.tables import printable
from ...redaction import scrubbed_text
from ..guard import Guarded

#: The environment variable the product reads (config.schema.PROBE_DIR_ENV; not imported: no torch here).
PROBE_DIR_ENV = "NEMO_MEMLOG_PROBE_DIR"
#: Measured logging steps every rank records at least: the first may precede the optimizer's state
#: (Adam's moments appear at the first step). A job that ends by itself after them was measured whole.
STEPS = 2
#: A rank's peak has stopped rising when its last STEADY_STEPS measured steps after the first (the
#: optimizer's state there) lie within this share of each other. On megatron-core's GPT a lifetime
#: peak creeps: 0.7193, 0.7385, 0.7555, 0.7555, 0.7587 GB over steps 1-5 (two steps read 2.7% low; on
#: a Megatron-LM job 3% and 8%); two steps within 1% stopped 5% low where a rise came later, three
#: within 1% read each stage within 2% of 8 steps (tests/test_fit.py).
STEADY = 0.01
STEADY_STEPS = 3
#: Measured steps after which a probe ends even where a peak still rises (``Probe.rising`` says so).
MAX_STEPS = 8
POLL_S = 0.2
#: How often a running probe says how far it is (``progress``), in seconds.
PROGRESS_S = 10.0
LOG_NAME = "probe.log"
#: A line of the command's output that says why it ended: an exception, an OOM, a kill. No
#: leading ``\w*``: it matched the same lines in time quadratic in a line's length.
_ERROR = re.compile(r"(?:Error|Exception)\b|[Oo]ut of memory|OOM|Killed|SIGKILL")
#: An error line that says the command ran out of memory (the kernel's OOM killer: SIGKILL, exit -9).
_MEMORY = re.compile(r"[Oo]ut of memory|OutOfMemory|MemoryError|OOM|Killed|SIGKILL|exitcode\s*:\s*-9|bad_alloc")
#: The end of the command's output kept and read (the cause and a launcher's summary are in it).
TAIL_BYTES = 32 << 10
#: A line of the output is shown cut to this many characters (around its error, where it has one).
LINE_CHARS = 300


@dataclass
class Probe:
    """What one launch at ``micro_batch_size`` gave: ``status`` "measured" (every rank's peak
    steady, or MAX_STEPS measured steps, or the command ended with 0 after STEPS), "died" (the
    command ended first, ``exit_code`` not 0), "ended" (it ended with 0 before that) or "timeout";
    or "recorded": no launch, the records of a run the user gave (fit --from-records), a measurement;
    the folder of its records and its output (``LOG_NAME``). ``peaks``: per rank, each measured
    step's peak as the polls saw it (GB); ``ranks_recorded``: the ranks steady (or at MAX_STEPS)."""

    micro_batch_size: int
    folder: Path
    status: str = ""
    exit_code: int | None = None
    seconds: float = 0.0
    ranks_recorded: int = 0
    world_size: int | None = None
    notes: list[str] = field(default_factory=list)
    output_tail: str = ""  # the command's last lines, where it died or ended on its own
    peaks: dict[int, dict[int, float]] = field(default_factory=dict)  # rank -> {measured step: peak GB}
    recent: bytes = b""  # the last TAIL_BYTES of its output (secrets scrubbed), kept as it ran

    def read_tail(self, lines: int = 12) -> str:
        """The last ``lines`` of the command's output, after the last line that names an error (a
        launcher's summary often follows the cause), each cut to LINE_CHARS, or "". Reads the last
        TAIL_BYTES only (what the probe kept, else the end of LOG_NAME)."""
        text = _tail_lines(self.recent or _file_end(self.folder / LOG_NAME))
        errors = [index for index, line in enumerate(text) if _ERROR.search(line)]
        shown = [_cut(line) for line in text[-lines:]]
        if errors and errors[-1] < len(text) - lines:
            shown.insert(0, _cut(text[errors[-1]]))
        return "\n".join(shown)

    @property
    def error_line(self) -> str:
        """The last line of the command's output (its kept end) that names an error, cut; or ""."""
        found = [line for line in _tail_lines(self.recent or _file_end(self.folder / LOG_NAME)) if _ERROR.search(line)]
        return _cut(found[-1]) if found else ""

    @property
    def out_of_memory(self) -> bool:
        """Whether the command died of memory: killed by SIGKILL (the OOM killer), or its last error
        line says so. A probe that died of anything else, or timed out, measured nothing."""
        if self.status != "died":
            return False
        return self.exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL) or bool(_MEMORY.search(self.error_line))

    @property
    def measured(self) -> bool:
        return self.status in ("measured", "recorded")

    @property
    def launched(self) -> bool:
        """Whether fit launched it (not the run of --from-records, read from its records)."""
        return self.status != "recorded"

    @property
    def steps(self) -> int:
        """The most measured steps a rank of the probe recorded (as the polls saw them)."""
        return max((max(seen) for seen in self.peaks.values() if seen), default=0)

    @property
    def rising(self) -> dict[int, float]:
        """The ranks whose peak still moved (more than STEADY) over their last STEADY_STEPS measured
        steps seen: rank -> the rise (a share). Empty for a probe whose every peak was steady."""
        out = {}
        for rank, seen in self.peaks.items():
            rise = _last_rise(seen)
            if rise is not None and rise > STEADY:
                out[rank] = rise
        return out


def _file_end(path: Path) -> bytes:
    """The last TAIL_BYTES of the file at ``path`` (b"" when it cannot be read): never the whole."""
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - TAIL_BYTES))
            return file.read(TAIL_BYTES)
    except OSError:
        return b""


def _tail_lines(data: bytes) -> list[str]:
    """The whole lines of ``data`` (a file's end: a first line cut by the cut is dropped)."""
    lines = data.decode(errors="replace").splitlines()
    return lines[1:] if len(data) >= TAIL_BYTES and len(lines) > 1 else lines


def _cut(line: str) -> str:
    """``line`` shown in at most about LINE_CHARS characters: around its error, where it names one."""
    if len(line) <= LINE_CHARS:
        return printable(line)
    match = _ERROR.search(line)
    start = max(0, min(match.start() - LINE_CHARS // 2, len(line) - LINE_CHARS)) if match else 0
    return printable(("..." if start else "") + line[start : start + LINE_CHARS] + "...")


def fresh_folder(folder: Path) -> None:
    """Make ``folder`` an empty folder: a probe reads only what its own launch wrote (a reused
    --work-dir keeps the last fit's records). Raises OSError where it cannot."""
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)
    elif folder.is_symlink() or folder.exists():
        folder.unlink()
    folder.mkdir(parents=True)


def run_probe(
    command: list[str],
    size: int,
    folder: Path,
    timeout_s: float,
    grace_s: float,
    secrets: Sequence[str] = (),
    scratch: Path | None = None,
    progress: Callable[[Probe, float], None] | None = None,
    stop: Callable[[Probe], bool] | None = None,
) -> Probe:
    """Launch ``command`` (the size already in it) under a guard (guard.py) with its records going to
    ``folder`` (emptied first); return when every rank's peak is steady (``steady``), or the command
    ended, or ``timeout_s`` passed, with every process it started ended (also when this
    raises: KeyboardInterrupt; a second one during the grace makes it SIGKILL, never abandons).
    ``scratch``: the folder the guard removes should fit end without ending the probe (SIGKILL).
    Its output goes to LOG_NAME with ``secrets`` and URI passwords scrubbed. ``progress(probe, seconds)``
    is called every PROGRESS_S while it runs (its ``ranks_recorded`` of ``world_size`` so far). ``stop(probe)``
    true at a poll ends it there, status "stopped" (its first records already tell enough)."""
    fresh_folder(folder)
    probe = Probe(size, folder)
    started = time.monotonic()
    with open(folder / LOG_NAME, "wb", buffering=0) as log:
        guarded = Guarded(command, {**os.environ, PROBE_DIR_ENV: str(folder)}, grace_s, scratch)
        copier = None
        try:
            copier = _Copier(guarded.stdout, log, list(secrets))
            _watch(guarded, probe, started + timeout_s, progress, stop)
        finally:
            late = guarded.end()
            probe.recent = copier.finish() if copier is not None else b""
        if late is not None:  # the first Ctrl-C or SIGTERM came as the probe was being ended
            raise late
    probe.seconds = time.monotonic() - started
    if probe.status in ("died", "ended", "timeout"):
        probe.output_tail = probe.read_tail()
    elif probe.status == "measured" and probe.rising:
        rises = ", ".join(f"rank {rank} +{rise * 100:.1f}%" for rank, rise in sorted(probe.rising.items()))
        _note(probe, f"a peak still rose at the last measured step ({rises}; at most {MAX_STEPS} steps are waited for)")
    return probe


class _Copier:
    """The command's output, copied from its pipe to the log on a thread of its own, with secrets
    scrubbed before any byte is written; its last TAIL_BYTES kept, so the tail is read without the
    log (which the command may delete, or make 500 MB)."""

    #: Output held back at most, waiting for a line's end (a secret is never cut in two: the last
    #: ``longest secret`` bytes are always held).
    HOLD = 1 << 20

    def __init__(self, pipe, log, secrets: list[str]):
        self.pipe, self.log, self.secrets = pipe, log, secrets
        self.keep = max((len(secret.encode()) for secret in secrets), default=0)
        self.recent = b""
        self.thread = threading.Thread(target=self._copy, name="nemo-memlog-probe-output", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        held: list[bytes] = []  # the output after the last line's end, not yet written
        size = 0
        try:
            while chunk := self.pipe.read1(1 << 16):
                newline = chunk.rfind(b"\n")
                if newline >= 0:
                    self._write(b"".join([*held, chunk[: newline + 1]]))
                    held, size = [chunk[newline + 1 :]], len(chunk) - newline - 1
                    continue
                held.append(chunk)
                size += len(chunk)
                if size > self.HOLD:  # a line without end: written but for its last bytes
                    data = self._scrub(b"".join(held))
                    cut = max(0, len(data) - self.keep)
                    self._write(data[:cut])
                    held, size = [data[cut:]], len(data) - cut
            self._write(b"".join(held))
        except (OSError, ValueError):  # the log's disk full, the pipe closed under us: nothing more is copied
            pass

    def _scrub(self, data: bytes) -> bytes:
        return scrubbed_text(data.decode(errors="replace"), self.secrets).encode() if data else data

    def _write(self, data: bytes) -> None:
        data = self._scrub(data)
        self.recent = (self.recent + data)[-TAIL_BYTES:]
        self.log.write(data)

    def finish(self) -> bytes:
        """Wait (a few seconds at most, every process of the command being ended) for the copy; the
        output's kept end."""
        self.thread.join(timeout=5.0)
        if not self.thread.is_alive():  # else a process out of reach holds the pipe: left to the thread
            self.pipe.close()
        return self.recent


def _watch(
    guarded: Guarded,
    probe: Probe,
    deadline: float,
    progress: Callable[[Probe, float], None] | None,
    stop: Callable[[Probe], bool] | None = None,
) -> None:
    started = said = time.monotonic()
    while True:
        if _recorded(probe):
            probe.status = "measured"
            return
        if stop is not None and stop(probe):
            probe.status = "stopped"
            return
        code = guarded.poll()
        if code is not None:
            probe.exit_code = code
            whole = _recorded(probe) or (code == 0 and _recorded(probe, ended=True))
            probe.status = "measured" if whole else ("ended" if code == 0 else "died")
            return
        now = time.monotonic()
        if now > deadline:
            probe.status = "timeout"
            return
        if progress is not None and now - said >= PROGRESS_S:
            said = now
            progress(probe, now - started)
        time.sleep(POLL_S)


def _note(probe: Probe, note: str) -> None:
    if note not in probe.notes:
        probe.notes.append(note)


def _whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _recorded(probe: Probe, ended: bool = False) -> bool:
    """Whether every rank's record in the probe's folder shows a steady peak (``steady``; with
    ``ended``, the command having ended by itself: STEPS measured steps), each step's peak noted in
    ``probe.peaks``. A record whose counts are not whole numbers counts as none yet (advise.load
    names it later); a folder the command removed, as no record."""
    try:
        names = [path.name for path in probe.folder.iterdir()]
    except OSError:
        return False
    for name in names:
        rank = layer_record.rank_of(name)
        record = layer_record.read_rank(probe.folder, rank) if rank is not None else None
        if rank is None or record is None:  # another file, or one that cannot be read (yet): a later poll
            continue
        for key in ("rank", "world_size", "measured_steps"):
            if _whole(record.get(key)) is None:
                _note(probe, f"{probe.folder / name}: field {key!r}: {record.get(key)!r:.40} is not a whole number")
        world_size = _whole(record.get("world_size"))
        probe.world_size = world_size if world_size else probe.world_size
        count = _whole(record.get("measured_steps")) or 0
        peak = stage_peak(record.get("stage"))
        seen = probe.peaks.setdefault(rank, {})
        if count and peak is not None:
            seen[count] = peak
        elif count:
            seen.setdefault(count, float("nan"))
    done = [seen for seen in probe.peaks.values() if (max(seen, default=0) >= STEPS if ended else steady(seen))]
    probe.ranks_recorded = len(done)
    return probe.world_size is not None and probe.ranks_recorded >= probe.world_size


def recorded_steps(probe: Probe) -> bool:
    """Whether the records of a run that has ended (its folder: ``probe.folder``) show every rank's
    STEPS measured steps at least, each rank's last peak noted in ``probe.peaks``."""
    return _recorded(probe, ended=True)


def stage_peak(stage: object) -> float | None:
    """A record's stage peak as advise reads it (its parts' sum: advice.stage_parts), GB; None
    where the record has no stage."""
    if not isinstance(stage, dict):
        return None
    value = advice.peak(advice.stage_parts(stage.get, PEAK_RESERVED.key in stage))
    return value if math.isfinite(value) else None


def steady(seen: dict[int, float]) -> bool:
    """Whether a rank's peaks by measured step (``seen``) have stopped rising: its last STEADY_STEPS
    seen steps, all from STEPS on (after the first), within STEADY; or MAX_STEPS steps recorded."""
    if max(seen, default=0) >= MAX_STEPS:
        return True
    rise = _last_rise(seen)
    return rise is not None and rise <= STEADY


def _last_rise(seen: dict[int, float]) -> float | None:
    """The share by which the peak moved over the last STEADY_STEPS steps seen from STEPS on (their
    highest over their lowest), or None with fewer or a figure missing."""
    steps = sorted(step for step in seen if step >= STEPS)[-STEADY_STEPS:]
    values = [seen[step] for step in steps]
    if len(steps) < STEADY_STEPS or not all(math.isfinite(value) and value > 0 for value in values):
        return None
    return max(values) / min(values) - 1.0
