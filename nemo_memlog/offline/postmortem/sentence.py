"""The post-mortem's words for one rank and for the run: the lead sentence (``sentence``), the
OOM's composition and advice clauses, the ambiguity and victims lines. Reads a
``state.Postmortem``; used by postmortem/render.py (the text) and postmortem/as_json.py."""

from __future__ import annotations

from collections import Counter

from ... import advice
from ...failure.records import PEER_LOSS
from ...keys import DEVICE_OTHER, HOST_LIMIT, HOST_LIMIT_USED, HOST_RSS, HOST_TOTAL
from ...measure import layer_record
from ...parts import MODEL_STATE_KEYS, OUTSIDE_GPU, STEP_KEYS
from ..tables import clock, finite_number, gb_text, size_text, whole_number
from .state import Postmortem, RankState

FRAGMENTATION_FIX = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
#: A clean end's reason (the recorder's word) in words.
END_WORDS = {"close": "closed by the run", "sigterm": "stopped by SIGTERM", "exit": "ended at interpreter exit"}


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
    try:
        run = advice.oom_run(report, oom, layer_record.read_rank(state.file.path.parent, state.rank))
        if run is None or run.capacity_gb is None:
            return ""
        fits = advice.would_have_fit(run)
    except (ArithmeticError, LookupError, TypeError, ValueError):  # a record of a shape nothing expected
        return ""
    if not fits:
        return "; no single change nemo-memlog advise knows would have fit it"
    listed = ", ".join(f"{text} (peak {gb_text(peak, scale=1)})" for text, peak in fits)
    return f"; predicted to fit (nemo-memlog advise): {listed}"


def composition_clause(report: dict) -> str:
    """ "; of 79.10 GB, 30.50 GB is model state (6.10 GB parameters, 6.10 GB gradients, 18.30 GB
    optimizer), 40.00 GB activations, 4.00 GB temporaries, 3.10 GB allocator slack, 1.50 GB outside
    the allocator" (sizes by the units rule: tables.size_text): what the memory was
    made of, from a report with the breakdown (a run that passed its model); "" without one.
    Temporaries are said where the record has them (activations measured, nemo_memlog 0.2+)."""
    parts = {key: finite_number(report.get(key)) for key in COMPOSITION}
    if parts["model_state_gb"] is None or parts["activations_gb"] is None:
        return ""
    other = parts[DEVICE_OTHER.key] or 0.0
    temporaries = parts["temporaries_gb"]
    total = parts["model_state_gb"] + parts["activations_gb"] + (temporaries or 0.0)
    total += (parts["allocator_slack_gb"] or 0.0) + other

    def size(key: str) -> str:
        return size_text(parts[key] or 0.0)

    said_temporaries = "" if temporaries is None else f"{size_text(temporaries)} temporaries, "
    return (
        f"; of {size_text(total)}, {size('model_state_gb')} is model state ({size('params_gb')} parameters, "
        f"{size('grads_gb')} gradients, {size('optimizer_state_gb')} optimizer), {size('activations_gb')} "
        f"activations, {said_temporaries}{size('allocator_slack_gb')} allocator slack, "
        f"{size_text(other)} {OUTSIDE_GPU}"
    )


COMPOSITION = (*MODEL_STATE_KEYS, *STEP_KEYS, DEVICE_OTHER.key)


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
    rss, total = state.live(HOST_RSS.key), state.value(HOST_TOTAL.key)
    limit, used = state.live(HOST_LIMIT.key), state.live(HOST_LIMIT_USED.key)
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
    ranks = "rank" if len(victims) == 1 else "ranks"
    return (
        f"died of rank {first.rank}'s loss ({len(victims)}): {ranks} {rank_ranges(sorted(s.rank for s in victims))}, "
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


def rank_ranges(ranks: list[int]) -> str:
    """Ranks as spans: [0, 1, 2, 5] -> "0-2, 5"."""
    spans, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            spans.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(spans)
