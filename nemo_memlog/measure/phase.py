"""``memory_phase(name)``: name what the run is doing (a checkpoint save, a load, an evaluation),
so that its memory peaks are logged under its name and a rank that dies inside it is said to.

    with nemo_memlog.memory_phase("checkpoint_save"):
        save_checkpoint(...)

For each phase, on this rank:

- Peaks over the phase alone: the host's peak RSS and, with ``memory_peak_window="interval"``
  only, the CUDA allocator's peak allocated and reserved bytes. Entering and leaving read the
  peak counters and reset them (``memory.fold_peaks``), which keeps what it resets, so the
  logging interval's own peak_* lose nothing.
- Logged at the next logging step, inside its one gather (no collective of its own), as
  ``memory/phase/<name>/peak_host_rss_gb``, ``.../peak_allocated_gb``, ``.../peak_reserved_gb``
  (CUDA) and ``.../seconds``: max over stages, ``memory/peak_stage/phase/<name>/...`` naming the
  stage. A phase run several times between two logging steps gives its largest values. A phase
  some stages ran and others did not lines up (reduce/protocol.py's optional ``phase/`` keys).
- Recorded: its start and end go into every open flight record of this process, and the liveness
  beat carries the phase a rank is in, so the post-mortem says a rank died during it.

Phases nest (an evaluation inside a save is measured as both); a phase left out of order (two
threads) is closed where it stands. A name that is not a short identifier raises ValueError at
entry. Measuring never raises into training: a failure there warns once and the phase goes on
unmeasured. Entering and leaving cost microseconds on CPU (docs/performance.md).

Per process, by nature: the open phases and the peaks waiting for a logging step belong to the
process (peak counters are per process), so they live here, not in a run; the first run of the
process to log takes them.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator

from ..keys import PEAK_ALLOCATED, PEAK_HOST_RSS, PEAK_RESERVED
from ..rank import memory
from ..warn import WarnOnce

NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
PREFIX = "phase/"
GB = 1e9


class _Phase:
    __slots__ = ("name", "iteration", "started", "device", "host")

    def __init__(self, name: str, iteration: int | None):
        self.name, self.iteration, self.started = name, iteration, time.time()
        self.device: dict = {}
        self.host = 0

    def fold(self, device: dict, host: int) -> None:
        for path, value in device.items():
            self.device[path] = max(self.device.get(path, 0), value)
        self.host = max(self.host, host)


class _Phases:
    """This process's memory phases: those open, innermost last, and the values of those ended,
    by name, waiting for a logging step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: list[_Phase] = []
        self.pending: dict[str, dict[str, float]] = {}
        self.owner = os.getpid()  # a forked child inherits its parent's lists: it starts with none
        self.warnings = WarnOnce()

    def own(self) -> None:
        if self.owner != os.getpid():
            self.owner = os.getpid()
            self.open.clear()
            self.pending.clear()


# Per process, not per run: a phase is entered by the user's code (``with memory_phase(...)``),
# which names no run, and it spans the process's peak counters, which every run reads.
_phases = _Phases()


class Slots:
    """Phases an integration opens in one callback and closes in another, by name: entering a
    name again closes the open one first; ``leave`` of a name not open does nothing."""

    def __init__(self) -> None:
        self._open: dict[str, _Phase] = {}

    def enter(self, name: str, iteration: int | None) -> None:
        self.leave(name)
        self._open[name] = enter(name, iteration)

    def leave(self, name: str) -> None:
        entered = self._open.pop(name, None)
        if entered is not None:
            leave(entered)

    def leave_all(self) -> None:
        for name in list(self._open):
            self.leave(name)


def check_name(name: str) -> str:
    """``name`` if it is a phase name (a lower-case identifier of at most 40 characters), else ValueError."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(
            f"memory_phase name {name!r} is not a short identifier: use lower-case letters, digits and "
            f"underscores, starting with a letter, at most 40 characters (e.g. 'checkpoint_save', 'eval')"
        )
    return name


@contextlib.contextmanager
def memory_phase(name: str, *, iteration: int | None = None) -> Iterator[None]:
    """Measure and record the ``with`` block as memory phase ``name``, on this rank.

    At the next logging step the phase's peaks over the block alone are logged, max over
    stages, as ``memory/phase/<name>/peak_host_rss_gb``, ``.../peak_allocated_gb`` and
    ``.../peak_reserved_gb`` (GB), and ``.../seconds``. The CUDA peaks need CUDA in use and
    ``memory_peak_window="interval"``: under the default "run" window the process's CUDA peak
    counters are left alone. The start and end go into every open flight record of this
    process. Phases nest; a phase run several times between two logging steps gives its
    largest values. No collective.

    Args:
        name: a lower-case identifier of at most 40 characters (``checkpoint_save``, ``eval``).
        iteration: the training iteration the phase belongs to, for the flight record
            (default: the last one a flight recorder of this process recorded).

    Raises:
        ValueError: ``name`` is not such an identifier (at entry, before the block runs).
            Nothing else: a failure to read the peaks warns once and the phase goes on
            unmeasured; exceptions from the block pass through.
    """
    check_name(name)
    phase = enter(name, iteration)
    try:
        yield
    finally:
        leave(phase)


def enter(name: str, iteration: int | None = None) -> _Phase:
    """Start phase ``name`` (for integrations whose start and end are two callbacks); ``leave`` ends it."""
    check_name(name)
    phase = _Phase(name, iteration)
    try:
        with _phases.lock:
            _phases.own()
            _fold_into_open()
            _phases.open.append(phase)
        _record(phase, "start")
    except Exception as error:  # measuring must not stop training
        _phases.warnings(("enter", type(error)), f"memory_phase({name!r}) could not read the peaks: {error}")
    return phase


def leave(phase: _Phase) -> None:
    """End ``phase`` (what ``enter`` returned): its peaks wait for the next logging step. Never raises."""
    try:
        with _phases.lock:
            _phases.own()
            if phase not in _phases.open:
                return  # left already, or entered before a fork
            _fold_into_open()
            _phases.open.remove(phase)
            _remember(phase)
        _record(phase, "end")
    except Exception as error:
        _phases.warnings(("leave", type(error)), f"memory_phase({phase.name!r}) could not read the peaks: {error}")


def current() -> _Phase | None:
    """The innermost open phase of this process, or None."""
    return _phases.open[-1] if _phases.open and _phases.owner == os.getpid() else None


def take_pending() -> dict[str, float]:
    """The report values of the phases ended since the last call (``phase/<name>/<key>``), and
    forget them. Called by a run at its logging step; cheap when there are none."""
    pending = _phases.pending
    if not pending:
        return {}
    with _phases.lock:
        _phases.own()
        taken = {f"{PREFIX}{name}/{key}": value for name, values in pending.items() for key, value in values.items()}
        pending.clear()
    return taken


def _fold_into_open() -> None:
    device, host = memory.fold_peaks()
    for phase in _phases.open:
        phase.fold(device, host)


def _remember(phase: _Phase) -> None:
    values = {PEAK_HOST_RSS.key: phase.host / GB, "seconds": time.time() - phase.started}
    for path, name in (
        (("allocated_bytes", "all", "peak"), PEAK_ALLOCATED.key),
        (("reserved_bytes", "all", "peak"), PEAK_RESERVED.key),
    ):
        if path in phase.device:
            values[name] = phase.device[path] / GB
    kept = _phases.pending.get(phase.name)
    if kept is not None:  # run again before a logging step: its largest values
        values = {key: max(value, kept.get(key, value)) for key, value in values.items()}
    _phases.pending[phase.name] = values


def _record(phase: _Phase, event: str) -> None:
    from ..failure.recorder import open_recorders

    for recorder in open_recorders():
        recorder.phase(phase.name, event, phase.iteration, phase.started)
