"""`nemo-memlog postmortem`: which rank failed first, and what every rank held, from the flight records.

Reads the per-rank ring files that recorder.py writes (their format: records.py) anywhere
below a folder, on the cluster or on a copy of it, through rank_files.py; prints nothing:
``analyse`` returns a ``Postmortem`` that postmortem/render.py and postmortem/as_json.py put
in words and postmortem/plot.py draws. No torch, no process group, no training code. Beside it:

- ``state``: what it finds, as data (``RankState``, ``Postmortem``);
- ``sentence``: the lead sentence, the OOM's composition and advice clauses, ambiguity and victims;
- ``render``: the text (``format_text``);
- ``as_json``: the JSON for a failure hook (``--json``);
- ``plot``: the PNG (the last records per stage, when each rank stopped).

Every rank that left a readable header gets exactly one status:

- ``closed``: an "end" record (a normal close, our SIGTERM handler, interpreter exit, or an
  exit through an unhandled exception; ``end_reason`` says which);
- ``cuda_oom``: an "oom" record (the allocator's OOM observer fired on this rank);
- ``unfinished``: neither: SIGKILL (the kernel's OOM killer, the scheduler), a segfault, a
  lost node, or a run still going.

Finer findings (``end_reason``, ``probable_host_oom_kill`` and its evidence) are fields of their own.

The first failure, among the failed ranks (``cuda_oom``, ``unfinished``, and ``closed`` with
end reason ``exception``): the earliest CUDA OOM by its record's time if there is one;
otherwise the rank that stopped first, where an unfinished rank stopped at its last liveness
beat (``alive``) and an exception at its end record's time. When another failed rank stopped
within the allowance of the first one's time, the post-mortem says it cannot tell which of
them failed first and names both. The allowance: a liveness time is up to one liveness period
(the header's ``liveness_period_s``, about 1 s) before the death, so it adds that period for
each side known only by its beat; ranks on different hosts add ``clock_skew_s`` (NTP keeps
nodes within milliseconds, not always) - on one host the clock is shared.

Consequences are not candidates. When one rank dies, its peers' next collective fails: gloo
raises "Connection closed by peer" or "Connection reset by peer", NCCL reports a remote or
aborted communicator, and the launcher SIGTERMs the rest. Such an end says a peer was lost,
not what killed it, so a rank whose exception reads like that (``records.PEER_LOSS``), or which ended
by SIGTERM, at or after a real candidate's failure (within the allowance) is listed as having
died of that candidate's loss (``RankState.died_of``, ``Postmortem.victims``) and is never named
first or ambiguous with it. Only when every failed rank reads like a lost peer (the rank that
died left no record) do they stay candidates.
"""

from __future__ import annotations

import bisect
import re
import time
from pathlib import Path

from ...bounded import ReadBudget, Refused
from ...failure import records
from ...keys import HOST_AVAILABLE, HOST_LIMIT, HOST_LIMIT_USED, HOST_TOTAL, PEAK_RESERVED
from ..rank_files import MAX_FILE_BYTES, RankFile, find_record_files, read_rank_file
from ..tables import finite_number, gb_text
from .state import (
    DEFAULT_CLOCK_SKEW_S,
    LOW_AVAILABLE_FRACTION,
    NEAR_LIMIT_FRACTION,
    Ambiguity,
    Postmortem,
    PostmortemError,
    RankState,
)

_RANK_IN_NAME = re.compile(r"rank-(\d+)")


# ---- analysis -----------------------------------------------------------------------------


def analyse(
    run_dir: str | Path,
    run_id: str | None = None,
    clock_skew_s: float = DEFAULT_CLOCK_SKEW_S,
    budget: ReadBudget | None = None,
) -> Postmortem:
    """Read every record file below ``run_dir`` and say who failed first.

    Files of several runs (run_id) in one folder: the run with the newest start is reported,
    or ``run_id``; the others are listed in ``ignored_runs``. Unreadable files are listed with
    the reason and the rank from their name; the other ranks are still reported. Raises
    PostmortemError when there is no folder, no record file, or no readable one, or files holding
    more than the read budget together (``budget``: bounded.ReadBudget, its cap and its progress).
    """
    run_dir = Path(run_dir)
    readable, unreadable = _read_all(run_dir, budget)
    chosen, ignored = _choose_run(readable, run_id, run_dir)
    files, duplicates = _one_per_rank(chosen)
    states = []
    for file in files:
        try:
            states.append(_state(file))
        except Exception as error:  # a record of a shape nothing expected: this rank, not the report
            unreadable.append((file.path, file.header["rank"], f"{type(error).__name__}: {error}"))
    if not states:
        reasons = "; ".join(f"{path}: {why}" for path, _, why in unreadable[:5])
        raise PostmortemError(f"{run_dir}: no record file readable ({reasons})")
    _host_evidence(states)
    failures = sorted((s for s in states if s.failed), key=_failure_order)
    failures, victims = _consequences(states, failures, clock_skew_s)
    first = failures[0] if failures else None
    world = max(s.header.get("world_size") or 0 for s in states)  # each checked by rank_files
    seen = {s.rank for s in states}
    missing = [rank for rank in range(world) if rank not in seen]
    postmortem = Postmortem(
        run_dir,
        chosen[0].header["run_id"],
        states,
        first,
        _ambiguity(first, failures, clock_skew_s),
        failures,
        unreadable,
        ignored,
        missing,
        duplicates,
        clock_skew_s,
    )
    postmortem.victims = victims
    postmortem.notes = _notes(postmortem)
    return postmortem


def _consequences(
    states: list[RankState], failures: list[RankState], clock_skew_s: float
) -> tuple[list[RankState], list[RankState]]:
    """The failures with the candidates first, and the ranks that died of the first candidate's loss
    (each marked ``died_of``): a lost-peer end at or after the first candidate's failure, within the
    allowance. Without a candidate (every failure reads like a lost peer) nothing changes."""
    candidates = [s for s in failures if not s.lost_a_peer]
    if not candidates or candidates[0].failure_time is None:
        return failures, []
    first = candidates[0]
    victims = []
    for state in sorted(states, key=_failure_order):
        if state is first or not state.lost_a_peer or state.failure_time is None:
            continue
        if state.failure_time >= first.failure_time - allowance_s(first, state, clock_skew_s):
            state.died_of = first
            victims.append(state)
    kept = [s for s in failures if s.died_of is None]
    return kept + [s for s in failures if s.died_of is not None], victims


def _read_all(
    run_dir: Path, budget: ReadBudget | None = None
) -> tuple[list[RankFile], list[tuple[Path, int | None, str]]]:
    """The readable rank files below ``run_dir``, and (file, rank from its name, why) for the others.
    Raises PostmortemError when there is no folder, no record file, or no readable one."""
    if not run_dir.is_dir():
        raise PostmortemError(
            f"{run_dir}: no such directory; expected the run's memory_record_dir "
            f"or a folder above it, holding rank-NNNNN{records.SUFFIX} files"
        )
    paths = find_record_files(run_dir)
    if not paths:
        raise PostmortemError(
            f"{run_dir}: no flight records (rank-NNNNN{records.SUFFIX}) found below it; "
            "recording is on whenever memory logging is (logger.memory_record_dir): "
            "point at the run folder the job wrote"
        )
    budget = ReadBudget() if budget is None else budget
    try:
        budget.reserve(paths, f"flight record files ({records.SUFFIX})", MAX_FILE_BYTES)
    except Refused as error:
        raise PostmortemError(f"{run_dir}: {error}") from None
    readable, unreadable = [], []
    for path in paths:
        try:
            readable.append(read_rank_file(path))
        except (OSError, ValueError, TypeError) as error:  # RecordError and bounded.Refused are ValueErrors
            match = _RANK_IN_NAME.search(path.name)
            unreadable.append((path, int(match.group(1)) if match else None, str(error)))
        budget.read_one()
    if not readable:
        reasons = "; ".join(f"{path}: {why}" for path, _, why in unreadable[:5])
        raise PostmortemError(f"{run_dir}: {len(paths)} record file(s), none readable ({reasons})")
    return readable, unreadable


def _choose_run(files: list[RankFile], run_id: str | None, run_dir: Path) -> tuple[list[RankFile], list[dict]]:
    """The files of ``run_id`` (default: the run that started last), and the other runs as ``ignored_runs``."""
    runs: dict[str, list[RankFile]] = {}
    for file in files:
        runs.setdefault(str(file.header["run_id"]), []).append(file)
    started = {rid: min(finite_number(f.header.get("started")) or 0.0 for f in group) for rid, group in runs.items()}
    if run_id is None:
        run_id = max(runs, key=lambda rid: (started[rid], rid))
    elif run_id not in runs:
        choices = ", ".join(f"{rid} ({len(group)} files)" for rid, group in runs.items())
        raise PostmortemError(f"{run_dir}: no records of run {run_id!r}; runs found: {choices}")
    ignored = [
        {
            "run_id": rid,
            "started": started[rid],
            "files": len(group),
            "dirs": sorted({str(f.path.parent) for f in group}),
        }
        for rid, group in sorted(runs.items(), key=lambda item: started[item[0]])
        if rid != run_id
    ]
    return runs[run_id], ignored


def _one_per_rank(files: list[RankFile]) -> tuple[list[RankFile], list[str]]:
    """One file per rank: where a run's rank appears twice (a copy), the one alive last wins."""
    by_rank: dict[int, RankFile] = {}
    duplicates = []
    for file in files:
        rank = int(file.header["rank"])
        kept = by_rank.get(rank)
        if kept is None or _last_beat(file) > _last_beat(kept):
            by_rank[rank] = file
        if kept is not None:
            duplicates.append(f"rank {rank}: {kept.path} and {file.path}; using {by_rank[rank].path}")
    return [by_rank[rank] for rank in sorted(by_rank)], duplicates


def _last_beat(file: RankFile) -> float:
    return finite_number((file.liveness or {}).get("alive")) or 0.0


def _state(file: RankFile) -> RankState:
    newest = file.newest()
    # An end counts when nothing came after it: after our SIGTERM handler a framework may train on.
    end = newest if newest is not None and newest.get("kind") == "end" else None
    oom = file.newest("oom")
    status = "cuda_oom" if oom is not None else "closed" if end is not None else "unfinished"
    last = file.newest(want=lambda record: isinstance(record.get("iteration"), int))
    with_report = file.newest(want=lambda record: isinstance(record.get("report"), dict) and record["report"])
    report = with_report["report"] if with_report else {}
    alive = finite_number((file.liveness or {}).get("alive"))
    if alive is None:  # never beat, or its slot torn: the newest record, else the start
        alive = finite_number(newest and newest.get("time")) or finite_number(file.header.get("started"))
    return RankState(
        file,
        status,
        end,
        oom,
        last["iteration"] if last else None,
        alive,
        report,
        finite_number(report.get(PEAK_RESERVED.key)),
    )


def _host_evidence(states: list[RankState]) -> None:
    """For each unfinished rank, the host's signs of the kernel's OOM killer: an oom_kill counter
    (vmstat: the host's; cgroup: the job's) that a rank on the same host saw higher after this
    rank's last beat (in a later beat, or in its end record), MemAvailable under
    LOW_AVAILABLE_FRACTION of the RAM at its last beat, and its memory cgroup at
    NEAR_LIMIT_FRACTION of its limit or more then. Linear in ranks (with a sort per host): an
    unfinished rank's own sightings are never after its last beat, so every sighting on its host
    after that beat is a mate's."""
    later_max = _later_maxima(states)
    for state in states:
        if state.status != "unfinished":
            continue
        own = state.file.liveness or {}
        for key, label in (("vmstat_oom_kill", "vmstat oom_kill"), ("cgroup_oom_kill", "cgroup oom_kill")):
            before = own.get(key)
            if not isinstance(before, int) or isinstance(before, bool):
                continue
            later = later_max(state.host, key, state.last_alive or 0)
            if later is not None and later > before:
                state.host_oom_kill_evidence.append(
                    f"{state.host}'s {label} counter went up after its last beat ({before} -> {later})"
                )
        available, total = state.live(HOST_AVAILABLE.key), state.value(HOST_TOTAL.key)
        if available is not None and total and available < LOW_AVAILABLE_FRACTION * total:
            state.host_oom_kill_evidence.append(
                f"MemAvailable was {gb_text(available, 1)} of {gb_text(total, 1)} at its last beat"
            )
        limit, used = state.live(HOST_LIMIT.key), state.live(HOST_LIMIT_USED.key)
        if limit and used is not None and used >= NEAR_LIMIT_FRACTION * limit:
            state.host_oom_kill_evidence.append(
                f"its memory cgroup was at {used:.2f} of its {limit:.2f} GB limit at its last beat"
            )


def _later_maxima(states: list[RankState]):
    """``later_max(host, key, after)``: the highest whole ``key`` a rank on ``host`` saw at a time after
    ``after`` (its beats and end records), None if none: per host and key, sightings by time and the
    maximum of each suffix, searched by bisection."""
    seen: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for state in states:
        for fields, when in _sightings(state):
            if finite_number(when) is None:
                continue
            for key in ("vmstat_oom_kill", "cgroup_oom_kill"):
                value = fields.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    seen.setdefault((state.host, key), []).append((when, value))
    tables = {}
    for where, sightings in seen.items():
        sightings.sort()
        suffix, best = [], None
        for _, value in reversed(sightings):
            best = value if best is None else max(best, value)
            suffix.append(best)
        tables[where] = ([when for when, _ in sightings], suffix[::-1])

    def later_max(host: str, key: str, after: float) -> int | None:
        times, suffix = tables.get((host, key), ((), ()))
        at = bisect.bisect_right(times, after)
        return suffix[at] if at < len(times) else None

    return later_max


def _sightings(state: RankState) -> tuple:
    """(fields, time) of what a rank saw of its host last: its last beat, and its end record."""
    end = state.end or {}
    return ((state.file.liveness or {}), state.last_alive), (end, end.get("time"))


def _failure_order(state: RankState) -> tuple:
    """The rule of the module docstring: CUDA OOMs first, each kind by time."""
    return (state.status != "cuda_oom", state.failure_time is None, state.failure_time or 0.0, state.rank)


def allowance_s(a: RankState, b: RankState, clock_skew_s: float) -> float:
    """How far apart two failure times can be and still be in either order."""
    beat = (0.0 if a.failure_time_exact else a.period) + (0.0 if b.failure_time_exact else b.period)
    return beat + (0.0 if a.host == b.host else clock_skew_s)


def _ambiguity(first: RankState | None, failures: list[RankState], clock_skew_s: float) -> Ambiguity | None:
    """The failed ranks that stopped within the allowance of the first failure, closest first; None if none."""
    if first is None or first.failure_time is None:
        return None
    close = []
    for other in failures[1:]:
        if other.failure_time is None or other.died_of is not None:
            continue
        gap = abs(other.failure_time - first.failure_time)
        if gap <= allowance_s(first, other, clock_skew_s):
            close.append((gap, other))
    if not close:
        return None
    close.sort(key=lambda item: (item[0], item[1].rank))
    others = [other for _, other in close]
    return Ambiguity(others, allowance_s(first, others[0], clock_skew_s))


def _notes(postmortem: Postmortem) -> list[str]:
    """A failure named first though another rank stopped earlier; a run that may still be going."""
    notes = []
    first = postmortem.first_failure
    if first is not None and first.status == "cuda_oom":
        earlier = [
            s
            for s in postmortem.failures
            if s.status != "cuda_oom"
            and s.failure_time is not None
            and first.failure_time is not None
            and s.failure_time < first.failure_time - allowance_s(first, s, postmortem.clock_skew_s)
        ]
        if earlier:
            stopped = min(earlier, key=lambda s: s.failure_time)
            gap = first.failure_time - stopped.failure_time
            notes.append(
                f"rank {stopped.rank} ({stopped.status}) stopped {gap:.1f} s "
                "before this CUDA OOM; a CUDA OOM is named first whenever there is one"
            )
    if first is not None and first.lost_a_peer:
        notes.append(
            "every failed rank's end says it lost a peer: the rank that died first left no readable record "
            "(see the ranks without one below), so the first of these is named"
        )
    alive = [s.last_alive for s in postmortem.ranks if s.status == "unfinished" and s.last_alive is not None]
    period = max(s.period for s in postmortem.ranks)
    if alive and time.time() - max(alive) < 3 * period:
        notes.append(
            f"a rank beat {time.time() - max(alive):.1f} s ago: the run may still be going, "
            "and its unfinished ranks be alive"
        )
    return notes
