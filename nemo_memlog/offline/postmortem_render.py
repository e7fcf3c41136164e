"""The post-mortem in words: the lead sentence, the table of ranks, what could not be read.

Reads a ``postmortem.Postmortem`` (no file); ``format_text`` returns the text
``nemo-memlog postmortem`` prints, ``sentence`` the first failure in one sentence (also in
the JSON, postmortem_json.py). Tables and numbers are formatted by tables.py.
"""

from __future__ import annotations

import math
import time
from collections import Counter

from .. import advice
from ..failure.records import PEER_LOSS
from ..measure import composition, layer_record
from .postmortem import STATUSES, Postmortem, RankState
from .tables import Column, cell, clock, date_time, finite_number, gb_cell, gb_text, render_block, whole_number

#: Up to this many ranks the table has every rank; above it, the failures, the first one's
#: pipeline and host, and a summary per pipeline stage (``--all`` for every row).
FULL_TABLE_MAX_RANKS = 64
SHOWN_FAILURES = 8
SHOWN_PROBLEMS = 20
FRAGMENTATION_FIX = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
#: A clean end's reason (the recorder's word) in words.
END_WORDS = {"close": "closed by the run", "sigterm": "stopped by SIGTERM", "exit": "ended at interpreter exit"}


# ---- the sentence -------------------------------------------------------------------------


def who(state: RankState) -> str:
    header = state.header
    return (
        f"rank {state.rank} (pp stage {header.get('pp_rank', '?')}, tp {header.get('tp_rank', '?')}, "
        f"dp {header.get('dp_rank', '?')}) on {state.host}"
    )


def sentence(postmortem: Postmortem) -> str:
    """The first failure in one sentence a person can act on; or that there was none."""
    first = postmortem.first_failure
    if first is None:
        reasons = Counter(s.end_reason or "?" for s in postmortem.ranks)
        counts = ", ".join(f"{n} {END_WORDS.get(reason, reason)}" for reason, n in sorted(reasons.items()))
        gaps = len(postmortem.missing_ranks) + len(postmortem.unreadable)
        tail = f"; {gaps} rank(s) left no readable record (see below)" if gaps else ""
        return f"no failure: all {len(postmortem.ranks)} ranks recorded a clean end ({counts}){tail}"
    if first.status == "cuda_oom":
        return _oom_sentence(first)
    if first.status == "closed":  # an exception: the only closed status that is a failure
        detail = (first.end or {}).get("detail") or "no detail recorded"
        return (
            f"{who(first)} exited through an unhandled exception at {clock(first.failure_time)}"
            f"{_at_iteration(first)}{during_phase(first)}: {detail}"
        )
    return _vanished_sentence(first)


def _oom_sentence(state: RankState) -> str:
    oom = state.oom
    requested, free = whole_number(oom.get("bytes_requested")), whole_number(oom.get("device_free"))
    reserved_free, largest = whole_number(oom.get("reserved_free")), whole_number(oom.get("largest_free_block"))
    at = _oom_iteration(state)
    text = f"{who(state)} hit a CUDA OOM {at} asking for {gb_text(requested)} with {gb_text(free)} free"
    text += composition_clause((state.oom or {}).get("report") or state.last_report)
    if fragmented(oom):
        return (
            f"{text}; {gb_text(free + reserved_free)} was free in total, but the largest free block was "
            f"{gb_text(largest)}, which is fragmentation: try {FRAGMENTATION_FIX}"
        )
    limit = whole_number(oom.get("device_limit"))
    does_not_fit = (
        f": the working set does not fit in {gb_text(limit)}; lower the micro-batch size, recompute "
        "activations, or spread the model over more pipeline or tensor-parallel ranks"
    ) + advice_clause(state)
    if reserved_free is None:
        return f"{text} (no allocator snapshot, so fragmentation cannot be told){does_not_fit}"
    return f"{text}; {gb_text(free + reserved_free)} was free in total with the allocator's cache{does_not_fit}"


def advice_clause(state: RankState) -> str:
    """ "; predicted to fit: distributed_optimizer=true (peak 61.0 GB), ...": the changes after which
    the failing rank's breakdown, with the request it could not serve, fits the device (advice/);
    the run's facts from its per-layer record beside the flight record. "" without a breakdown."""
    oom = state.oom or {}
    report = oom.get("report") or state.last_report
    run = advice.oom_run(report, oom, layer_record.read_rank(state.file.path.parent, state.rank))
    if run is None or run.capacity_gb is None:
        return ""
    fits = advice.would_have_fit(run)
    if not fits:
        return "; no single change nemo-memlog advise knows would have fit it"
    listed = ", ".join(f"{text} (peak {gb_text(peak, scale=1)})" for text, peak in fits)
    return f"; predicted to fit (nemo-memlog advise): {listed}"


def composition_clause(report: dict) -> str:
    """ "; of 79.1 GB, 30.5 is model state (6.1 parameters, 6.1 gradients, 18.3 optimizer), 40.0
    activations, 4.0 temporaries, 3.1 allocator slack, 1.5 outside the allocator": what the memory was
    made of, from a report with the breakdown (a run that passed its model); "" without one.
    Temporaries are said where the record has them (activations measured, nemo_memlog 0.2+)."""
    parts = {key: finite_number(report.get(key)) for key in COMPOSITION}
    if parts["model_state_gb"] is None or parts["activations_gb"] is None:
        return ""
    other = parts["device_other_gb"] or 0.0
    temporaries = parts["temporaries_gb"]
    total = parts["model_state_gb"] + parts["activations_gb"] + (temporaries or 0.0)
    total += (parts["allocator_slack_gb"] or 0.0) + other
    said_temporaries = "" if temporaries is None else f"{temporaries:.1f} temporaries, "
    return (
        f"; of {total:.1f} GB, {parts['model_state_gb']:.1f} is model state ({parts['params_gb'] or 0:.1f} "
        f"parameters, {parts['grads_gb'] or 0:.1f} gradients, {parts['optimizer_state_gb'] or 0:.1f} optimizer), "
        f"{parts['activations_gb']:.1f} activations, {said_temporaries}"
        f"{parts['allocator_slack_gb'] or 0:.1f} allocator slack, {other:.1f} outside the allocator"
    )


COMPOSITION = (*composition.NAMES, *composition.DERIVED, "device_other_gb")


def _oom_iteration(state: RankState) -> str:
    """The recorder names the last iteration it saw: past the last step record, the OOM's own."""
    iteration = state.oom.get("iteration")
    step = state.file.newest("step", want=lambda record: isinstance(record.get("iteration"), int))
    recorded = step and step["iteration"]
    if isinstance(iteration, int) and (recorded is None or iteration > recorded):
        return f"at iteration {iteration}"
    return "at an unknown iteration" if recorded is None else f"after iteration {recorded} (the last recorded)"


def fragmented(oom: dict) -> bool:
    """Enough memory sat free inside the allocator's segments, in no block big enough."""
    requested, reserved_free = whole_number(oom.get("bytes_requested")), whole_number(oom.get("reserved_free"))
    largest = whole_number(oom.get("largest_free_block"))
    if None in (requested, reserved_free, largest):
        return False
    return reserved_free >= requested > largest


def _vanished_sentence(state: RankState) -> str:
    rss, total = state.live("host_rss_gb"), state.value("host_total_gb")
    limit, used = state.live("host_limit_gb"), state.live("host_limit_used_gb")
    memory = ""
    if rss is not None and limit:  # the job's limit binds, not the node's RAM: say that one
        memory = f" with host RSS {gb_text(rss, 1)}, the job's memory cgroup at {used:.2f} of its {limit:.2f} GB limit"
    elif rss is not None:
        memory = f" with host RSS {gb_text(rss, 1)}" + (f" of {gb_text(total, 1)}" if total else "")
    text = f"{who(state)} vanished at {clock(state.last_alive)} (last alive){_at_iteration(state)}{memory}"
    text += during_phase(state)
    if state.host_oom_kill_evidence:
        return (
            f"{text} while {'; '.join(state.host_oom_kill_evidence)}: probably the kernel's OOM killer "
            f"(check `dmesg` on {state.host})"
        )
    return (
        f"{text}, without recording an end: a SIGKILL (scheduler, OOM killer), a crash or a lost node; "
        f"no sign of the OOM killer in what {state.host}'s ranks recorded"
    )


def during_phase(state: RankState) -> str:
    """ ", during checkpoint_save, which began at iteration 4000, 12 s before its last beat"", or ""."""
    phase = state.open_phase
    if phase is None:
        return ""
    text = f", during {phase['name']}"
    parts = []
    if isinstance(phase.get("iteration"), int):
        parts.append(f"at iteration {phase['iteration']}")
    started, stopped = phase.get("started"), state.failure_time
    if isinstance(started, (int, float)) and stopped is not None:
        end = "its last beat" if not state.failure_time_exact else "it stopped"
        parts.append(f"{stopped - started:.0f} s before {end}")
    return text + (f", which began {', '.join(parts)}" if parts else "")


def _at_iteration(state: RankState) -> str:
    return "" if state.last_iteration is None else f", after iteration {state.last_iteration} (last recorded)"


def ambiguity_line(postmortem: Postmortem) -> str | None:
    first, ambiguity = postmortem.first_failure, postmortem.ambiguity
    if ambiguity is None:
        return None
    other = ambiguity.others[0]
    gap = abs(other.failure_time - first.failure_time)
    same_host = other.host == first.host
    where = f"on one host ({first.host})" if same_host else f"on different hosts ({first.host}, {other.host})"
    beats = [s for s in (first, other) if not s.failure_time_exact]
    parts = (
        [
            f"{' and '.join(f'rank {s.rank}' for s in beats)}: a last beat may be up to a liveness period "
            f"({max(s.period for s in beats):g} s) before the death"
        ]
        if beats
        else []
    )
    if not same_host:
        parts.append(f"the hosts' clocks may differ by {postmortem.clock_skew_s:g} s (--clock-skew-s)")
    line = (
        f"cannot tell which of rank {first.rank} and rank {other.rank} failed first: they stopped "
        f"{gap:.2f} s apart {where}, within the {ambiguity.allowance_s:.2f} s allowance ({'; '.join(parts)})"
    )
    more = len(ambiguity.others) - 1
    if more:
        line += f"; {more} more failed rank(s) stopped within the same allowance"
    if not postmortem.victims and len(ambiguity.others) + 1 >= max(2, len(postmortem.ranks) // 2):
        line += ". Most ranks stopped together: the job was probably stopped from outside (scheduler, node loss)"
    return line


def victims_line(postmortem: Postmortem) -> str | None:
    """The ranks that died of the first failure's loss, and what their ends said."""
    victims = postmortem.victims
    if not victims:
        return None
    first = postmortem.first_failure
    ends = Counter(_victim_end(s) for s in victims)
    said = "; ".join(f"{n} {text}" for text, n in ends.most_common(3))
    return (
        f"died of rank {first.rank}'s loss ({len(victims)}): ranks {_ranges(sorted(s.rank for s in victims))}, "
        f"after it ({said}): consequences, not other failures"
    )


def _victim_end(state: RankState) -> str:
    if state.end_reason == "sigterm":
        return "stopped by SIGTERM"
    # The last match: our own "a peer left" quotes gloo's or NCCL's words after it.
    matches = list(PEER_LOSS.finditer(str((state.end or {}).get("detail") or "")))
    return f"raised '{matches[-1].group(0)}'" if matches else "raised"


def stopped_after_first(postmortem: Postmortem, state: RankState) -> float | None:
    """Seconds from the first failure to this rank's stop (``failure_time``): what the table's
    "after first" column, the JSON's ``stopped_after_first_s`` and the PNG's lower panel show."""
    first = postmortem.first_failure
    if first is None or first.failure_time is None or state.failure_time is None:
        return None
    return state.failure_time - first.failure_time


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
    return "\n".join(lines)


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


def _finding(postmortem: Postmortem, state: RankState) -> str:
    parts = []
    if state is postmortem.first_failure:
        parts.append("FIRST")
    elif postmortem.ambiguity and state in postmortem.ambiguity.others:
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

    return [
        Column("rank", "rank", [str(s.rank) for s in shown]),
        Column("rank", "pp", header("pp_rank")),
        Column("rank", "tp", header("tp_rank")),
        Column("rank", "dp", header("dp_rank")),
        Column("rank", "host", [s.host for s in shown], left=True),
        Column("outcome", "status", [s.status for s in shown], left=True),
        Column("outcome", "finding", [_finding(postmortem, s) for s in shown], left=True),
        Column("outcome", "last iter", [cell(s.last_iteration) for s in shown]),
        Column("device GB", "peak reserved", [gb_cell(s.peak_reserved_gb) for s in shown]),
        Column("device GB", "headroom", [gb_cell(s.headroom_gb) for s in shown]),
        Column("host GB", "RSS", [gb_cell(s.live("host_rss_gb")) for s in shown]),
        Column("host GB", "MemAvailable", [gb_cell(s.live("host_available_gb")) for s in shown]),
        *_limit_columns(shown),
        Column("stopped", "at", [clock(s.failure_time, fraction=True) for s in shown]),
        Column("stopped", "after first", [_after_first(postmortem, s) for s in shown]),
    ]


def _limit_columns(shown: list[RankState]) -> list[Column]:
    """The memory cgroup's usage and limit at the last beat, where any rank ran under a limit."""
    if not any(s.live("host_limit_gb") for s in shown):
        return []
    return [
        Column("host GB", "cgroup used", [gb_cell(s.live("host_limit_used_gb")) for s in shown]),
        Column("host GB", "limit", [gb_cell(s.live("host_limit_gb")) for s in shown]),
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
        Column("GB", "max host RSS", [extreme(g, lambda s: s.live("host_rss_gb"), max) for _, g in rows]),
        Column("GB", "least MemAvailable", [extreme(g, lambda s: s.live("host_available_gb"), min) for _, g in rows]),
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
            f"copied): {_ranges(missing)}",
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


def _ranges(ranks: list[int]) -> str:
    spans, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            spans.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(spans)
