"""What ``nemo-memlog postmortem`` finds, as data: every rank's state (``RankState``), the first
failure and what could not be read (``Postmortem``). Built by postmortem.py's ``analyse``, put in
words by postmortem/render.py and postmortem/as_json.py, drawn by postmortem/plot.py. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...failure import records
from ...keys import DEVICE_OTHER, DEVICE_TOTAL
from ..rank_files import RankFile
from ..tables import finite_number

DEFAULT_CLOCK_SKEW_S = 2.0
DEFAULT_LIVENESS_PERIOD_S = 1.0
#: MemAvailable below this share of the host's RAM at a rank's last beat counts as evidence
#: that the kernel's OOM killer took it.
LOW_AVAILABLE_FRACTION = 0.05
#: A memory cgroup at or above this share of its limit at a rank's last beat counts as evidence
#: that the kernel's OOM killer took it (the kernel reclaims caches first, so usage sits just under).
NEAR_LIMIT_FRACTION = 0.95
STATUSES = ("closed", "cuda_oom", "unfinished")


class PostmortemError(Exception):
    """Nothing can be reported (no folder, no readable record); the message says what to change."""


@dataclass(eq=False)  # identity: one object per rank
class RankState:
    """What the post-mortem says about one rank."""

    file: RankFile
    status: str
    end: dict | None  # the end record
    oom: dict | None  # the oom record
    last_iteration: int | None
    last_alive: float | None  # liveness time; else the last record's; else the start
    last_report: dict  # the newest record's report ({} without one)
    peak_reserved_gb: float | None  # in that report
    host_oom_kill_evidence: list[str] = field(default_factory=list)
    died_of: RankState | None = None  # the candidate whose loss ended this rank (see the module docstring)

    @property
    def header(self) -> dict:
        return self.file.header

    @property
    def rank(self) -> int:
        return self.header["rank"]

    @property
    def host(self) -> str:
        return str(self.header.get("host", "?"))

    @property
    def period(self) -> float:
        return float(self.header.get("liveness_period_s") or DEFAULT_LIVENESS_PERIOD_S)

    @property
    def end_reason(self) -> str | None:
        return self.end and self.end.get("reason")

    @property
    def failed(self) -> bool:
        return self.status != "closed" or self.end_reason == "exception"

    @property
    def failure_time(self) -> float | None:
        """When it failed: the OOM record's time, the exception's end record, else the last beat."""
        if self.oom is not None:
            return finite_number(self.oom.get("time"))
        if self.end is not None:
            return finite_number(self.end.get("time"))
        return self.last_alive

    @property
    def lost_a_peer(self) -> bool:
        """Its end says a peer was lost: an exception in PEER_LOSS's words, or a SIGTERM (the launcher's
        answer to another rank's death). Whether it came after a candidate's failure is analyse's call."""
        if self.status != "closed":
            return False
        if self.end_reason == "sigterm":
            return True
        detail = str((self.end or {}).get("detail") or "")
        return self.end_reason == "exception" and bool(records.PEER_LOSS.search(detail))

    @property
    def open_phase(self) -> dict | None:
        """The memory phase (measure/phase.py) this rank was in when it stopped: {"name", "started",
        "iteration"}, from its last beat, else from a phase record with no end after it; None."""
        beat = self.file.liveness or {}
        if isinstance(beat.get("phase"), str):
            return {
                "name": beat["phase"],
                "started": beat.get("phase_started"),
                "iteration": beat.get("phase_iteration"),
            }
        newest = self.file.newest("phase")
        if newest is not None and newest.get("event") == "start":
            return {"name": newest.get("name"), "started": newest.get("started"), "iteration": newest.get("iteration")}
        return None

    @property
    def failure_time_exact(self) -> bool:
        """A record's time is the event's; a last beat is up to one liveness period before it."""
        return self.oom is not None or self.end is not None

    @property
    def probable_host_oom_kill(self) -> bool:
        return bool(self.host_oom_kill_evidence)

    def value(self, key: str) -> float | None:
        """A number of the last report, None where missing (NaN, absent)."""
        return finite_number(self.last_report.get(key))

    def live(self, key: str) -> float | None:
        """A liveness number (fresher, about once a second), else the last report's."""
        value = finite_number((self.file.liveness or {}).get(key))
        return self.value(key) if value is None else value

    @property
    def headroom_gb(self) -> float | None:
        """Device headroom as the logged ``memory/headroom_gb``: total - other - peak reserved."""
        total, peak = self.value(DEVICE_TOTAL.key), self.peak_reserved_gb
        if total is None or peak is None:
            return None
        return total - (self.value(DEVICE_OTHER.key) or 0.0) - peak


@dataclass
class Ambiguity:
    """Failed ranks that stopped too close to the first failure to order them."""

    others: list[RankState]
    allowance_s: float  # for the closest one


@dataclass
class Postmortem:
    """One run's post-mortem: every rank's state, the first failure, and what could not be read."""

    run_dir: Path
    run_id: str
    ranks: list[RankState]  # by rank
    first_failure: RankState | None
    ambiguity: Ambiguity | None
    failures: list[RankState]  # every failed rank, in the order of the rule
    unreadable: list[tuple[Path, int | None, str]]  # (file, rank from its name, why)
    ignored_runs: list[dict]  # {"run_id", "started", "files", "dirs"}
    missing_ranks: list[int]
    duplicates: list[str]
    clock_skew_s: float
    notes: list[str] = field(default_factory=list)
    victims: list[RankState] = field(default_factory=list)  # ranks that died of the first failure's loss

    @property
    def world_size(self) -> int:
        return max(int(r.header.get("world_size") or 0) for r in self.ranks) or len(self.ranks)
