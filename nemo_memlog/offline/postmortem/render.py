"""The post-mortem in words: the lead sentence, the table of ranks, what could not be read.

Reads a ``postmortem.Postmortem`` (no file); ``format_text`` returns the text
``nemo-memlog postmortem`` prints, ``sentence`` the first failure in one sentence (also in
the JSON, postmortem/as_json.py). Tables and numbers are formatted by tables.py.
"""

from __future__ import annotations

import math
import time
from collections import Counter

from ...keys import HOST_AVAILABLE, HOST_LIMIT, HOST_LIMIT_USED, HOST_RSS
from ..tables import Column, cell, clock, date_time, gb_cell, printable, render_block
from .sentence import ambiguity_line, fragmented, rank_ranges, sentence, stopped_after_first, victims_line
from .state import STATUSES, Postmortem, RankState

#: Up to this many ranks the table has every rank; above it, the failures, the first one's
#: pipeline and host, and a summary per pipeline stage (``--all`` for every row).
FULL_TABLE_MAX_RANKS = 64
SHOWN_FAILURES = 8
SHOWN_PROBLEMS = 20


# ---- the text -----------------------------------------------------------------------------


def format_text(postmortem: Postmortem, all_rows: bool = False) -> str:
    """Lead sentence, ambiguity, notes, the table, the per-stage summary, what could not be read."""
    ranks = postmortem.ranks
    started = min((s.header.get("started") or math.inf) for s in ranks)
    lines = [
        f"post-mortem of run {postmortem.run_id} under {postmortem.run_dir}: {len(ranks)} of "
        f"{postmortem.world_size} ranks read, {len({s.host for s in ranks})} host(s), {_shape(ranks)}",
        f"started {date_time(started)}; times are this machine's local time ({time.strftime('%Z %z')})",
        "",
        "FIRST FAILURE: " + sentence(postmortem),
    ]
    first = postmortem.first_failure
    if first is not None and first.oom and first.oom.get("snapshot"):
        snapshot = first.file.path.parent / first.oom["snapshot"]
        lines.append(f"allocator snapshot: {snapshot} (open it at pytorch.org/memory_viz)")
    lines += [line for line in [ambiguity_line(postmortem), victims_line(postmortem)] if line]
    lines += [f"note: {note}" for note in postmortem.notes]
    counts = Counter(s.status for s in ranks)
    lines += [
        "",
        "status: " + ", ".join(f"{counts.get(status, 0)} {status}" for status in STATUSES) + _failures_tail(postmortem),
    ]
    shown = ranks if all_rows or len(ranks) <= FULL_TABLE_MAX_RANKS else _selected(postmortem)
    if len(shown) < len(ranks):
        lines.append(
            f"showing {len(shown)} of {len(ranks)} ranks: the first {SHOWN_FAILURES} failures, the first "
            "failure's pipeline and host, ranks with unreadable slots (--all: every rank)"
        )
    if shown:
        lines += [""] + render_block(_rank_columns(postmortem, shown))
    if len(shown) < len(ranks):
        lines += ["", "per pipeline stage:"] + render_block(_stage_columns(ranks))
    lines += _problem_lines(postmortem)
    return "\n".join(map(printable, lines))  # a record's text (a host, a reason) cannot forge a line


def _failures_tail(postmortem: Postmortem) -> str:
    failures = postmortem.failures
    if not failures:
        return ""
    order = ", ".join(str(s.rank) for s in failures[:SHOWN_FAILURES])
    more = f", ... ({len(failures)} in all)" if len(failures) > SHOWN_FAILURES else ""
    return f"; failed ranks in order: {order}{more}"


def _shape(ranks: list[RankState]) -> str:
    sizes = [len({s.header.get(key) for s in ranks}) for key in ("pp_rank", "tp_rank", "dp_rank")]
    return "pp {} x tp {} x dp {} seen".format(*sizes)


def _selected(postmortem: Postmortem) -> list[RankState]:
    first = postmortem.first_failure
    chosen = {s.rank: s for s in postmortem.failures[:SHOWN_FAILURES]}
    if postmortem.ambiguity:
        chosen.update((s.rank, s) for s in postmortem.ambiguity.others[:SHOWN_FAILURES])
    if first is not None:
        mates = (
            s
            for s in postmortem.ranks
            if s.host == first.host
            or (s.header.get("tp_rank"), s.header.get("dp_rank"))
            == (first.header.get("tp_rank"), first.header.get("dp_rank"))
        )
        chosen.update((s.rank, s) for s in mates)
    chosen.update((s.rank, s) for s in [s for s in postmortem.ranks if s.file.problems][:SHOWN_FAILURES])
    return [chosen[rank] for rank in sorted(chosen)]


def _finding(postmortem: Postmortem, state: RankState, ambiguous: set[int]) -> str:
    parts = []
    if state is postmortem.first_failure:
        parts.append("FIRST")
    elif id(state) in ambiguous:
        parts.append("first?")
    elif state.died_of is not None:
        parts.append(f"died of r{state.died_of.rank}'s loss")
    if state.end_reason:
        parts.append(state.end_reason)
    if state.oom is not None and fragmented(state.oom):
        parts.append("fragmented")
    if state.probable_host_oom_kill:
        parts.append("host OOM kill?")
    if state.file.problems:
        parts.append("torn slots")
    return ", ".join(parts) or "-"


def _rank_columns(postmortem: Postmortem, shown: list[RankState]) -> list[Column]:
    def header(key):
        return [str(s.header.get(key, "?")) for s in shown]

    ambiguous = {id(s) for s in postmortem.ambiguity.others} if postmortem.ambiguity else set()

    return [
        Column("rank", "rank", [str(s.rank) for s in shown]),
        Column("rank", "pp", header("pp_rank")),
        Column("rank", "tp", header("tp_rank")),
        Column("rank", "dp", header("dp_rank")),
        Column("rank", "host", [s.host for s in shown], left=True),
        Column("outcome", "status", [s.status for s in shown], left=True),
        Column("outcome", "finding", [_finding(postmortem, s, ambiguous) for s in shown], left=True),
        Column("outcome", "last iter", [cell(s.last_iteration) for s in shown]),
        Column("device GB", "peak reserved", [gb_cell(s.peak_reserved_gb) for s in shown]),
        Column("device GB", "headroom", [gb_cell(s.headroom_gb) for s in shown]),
        Column("host GB", "RSS", [gb_cell(s.live(HOST_RSS.key)) for s in shown]),
        Column("host GB", "MemAvailable", [gb_cell(s.live(HOST_AVAILABLE.key)) for s in shown]),
        *_limit_columns(shown),
        Column("stopped", "at", [clock(s.failure_time, fraction=True) for s in shown]),
        Column("stopped", "after first", [_after_first(postmortem, s) for s in shown]),
    ]


def _limit_columns(shown: list[RankState]) -> list[Column]:
    """The memory cgroup's usage and limit at the last beat, where any rank ran under a limit."""
    if not any(s.live(HOST_LIMIT.key) for s in shown):
        return []
    return [
        Column("host GB", "cgroup used", [gb_cell(s.live(HOST_LIMIT_USED.key)) for s in shown]),
        Column("host GB", "limit", [gb_cell(s.live(HOST_LIMIT.key)) for s in shown]),
    ]


def _after_first(postmortem: Postmortem, state: RankState) -> str:
    gap = stopped_after_first(postmortem, state)
    return "-" if gap is None else f"{gap:+.2f} s"


def _stage_columns(ranks: list[RankState]) -> list[Column]:
    stages: dict = {}
    for state in ranks:
        stages.setdefault(state.header.get("pp_rank"), []).append(state)
    rows = [(stage, stages[stage]) for stage in sorted(stages, key=lambda s: (not isinstance(s, int), str(s)))]

    def extreme(group, value, pick):
        found = [(value(s), s.rank) for s in group if value(s) is not None]
        if not found:
            return "-"
        number, rank = pick(found)
        return f"{gb_cell(number)} (r{rank})"

    def alive_range(group):
        times = [s.failure_time for s in group if s.failure_time is not None]
        return f"{clock(min(times), True)}..{clock(max(times), True)}" if times else "-"

    def iterations(group):
        found = [s.last_iteration for s in group if s.last_iteration is not None]
        return f"{min(found)}..{max(found)}" if found else "-"

    return [
        Column("", "pp stage", [str(stage) for stage, _ in rows]),
        Column("", "ranks", [str(len(group)) for _, group in rows]),
        *[
            Column("status", status, [str(sum(s.status == status for s in group)) for _, group in rows])
            for status in STATUSES
        ],
        Column("", "last iter", [iterations(group) for _, group in rows]),
        Column("GB", "max peak reserved", [extreme(g, lambda s: s.peak_reserved_gb, max) for _, g in rows]),
        Column("GB", "least headroom", [extreme(g, lambda s: s.headroom_gb, min) for _, g in rows]),
        Column("GB", "max host RSS", [extreme(g, lambda s: s.live(HOST_RSS.key), max) for _, g in rows]),
        Column("GB", "least MemAvailable", [extreme(g, lambda s: s.live(HOST_AVAILABLE.key), min) for _, g in rows]),
        Column("", "stopped", [alive_range(group) for _, group in rows]),
    ]


def _problem_lines(postmortem: Postmortem) -> list[str]:
    lines = []
    if postmortem.unreadable:
        lines += ["", f"unreadable record files ({len(postmortem.unreadable)}; their ranks are not in the table):"]
        lines += [
            f"  {path}: {why}" + ("" if rank is None else f" (rank {rank} by its name)")
            for path, rank, why in postmortem.unreadable[:SHOWN_PROBLEMS]
        ]
        lines += _more(postmortem.unreadable)
    torn = [s for s in postmortem.ranks if s.file.problems]
    if torn:
        lines += ["", f"ranks with torn or corrupted slots ({len(torn)}; their other slots are used):"]
        lines += [f"  rank {s.rank} ({s.file.path}): {'; '.join(s.file.problems)}" for s in torn[:SHOWN_PROBLEMS]]
        lines += _more(torn)
    unread = {rank for _, rank, _ in postmortem.unreadable}
    missing = [rank for rank in postmortem.missing_ranks if rank not in unread]
    if missing:
        lines += [
            "",
            f"ranks with no record file ({len(missing)}; never started recording, or their files were not "
            f"copied): {rank_ranges(missing)}",
        ]
    if postmortem.ignored_runs:
        files = sum(run["files"] for run in postmortem.ignored_runs)
        lines += [
            "",
            f"ignored {files} record file(s) of {len(postmortem.ignored_runs)} other run(s) in the same "
            f"folder (reported: run {postmortem.run_id}, the newest start, or --run-id):",
        ]
        lines += [
            f"  run {run['run_id']}, started {date_time(run['started'])}: {run['files']} file(s) in "
            + ", ".join(run["dirs"][:3])
            + (" ..." if len(run["dirs"]) > 3 else "")
            for run in postmortem.ignored_runs
        ]
    if postmortem.duplicates:
        lines += ["", "ranks with two record files in this run (kept the one alive last):"]
        lines += [f"  {text}" for text in postmortem.duplicates[:SHOWN_PROBLEMS]]
    return lines


def _more(items: list) -> list[str]:
    return [f"  ... and {len(items) - SHOWN_PROBLEMS} more (--json lists all)"] if len(items) > SHOWN_PROBLEMS else []
