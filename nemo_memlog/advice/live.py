"""The advice read from a run as it logs (a logging step's unified dict, the low-headroom warning)
and at a CUDA OOM (the post-mortem's one-stage run)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .model import MODEL_STATE, Run, Stage, fmt, parse
from .predict import Refused, predict, smallest_fix

# ---- live: from a logging step's unified dict ------------------------------------------------

PREFIX = "memory/"


def stage_parts(figure: Callable[[str], Any], gpu: bool) -> dict:
    """One stage's parts (PARTS) from its figures as logged: ``figure(name)`` is a logged name's
    value, or None. GPU: temporaries, slack and the memory outside the allocator as measured; CPU:
    the rest of the process's peak resident memory, split where its idle size was measured
    (``host_idle_rss_gb``, measure/host_idle.py) into ``outside_gb`` (idle, beyond the model state)
    and ``temporaries_gb`` (the working set of the microbatch computed at the peak), else all
    ``outside_gb``. A figure that is absent or NaN counts as 0."""
    parts = {name: _gb(figure(name)) for name in (*MODEL_STATE, "activations_gb")}
    if gpu:
        parts["temporaries_gb"] = _gb(figure("temporaries_gb"))
        parts["allocator_slack_gb"] = _gb(figure("allocator_slack_gb"))
        parts["outside_gb"] = _gb(figure("device_other_gb"))
    else:
        rest = max(_gb(figure("peak_host_rss_gb")) - sum(parts.values()), 0.0)
        idle = _gb(figure("host_idle_rss_gb"))
        if idle:  # the idle size beyond the model state stays; what the microbatch adds grows with it
            outside = min(max(idle - sum(parts[name] for name in MODEL_STATE), 0.0), rest)
            parts["temporaries_gb"] = rest - outside
            parts["outside_gb"] = outside
        else:
            parts["outside_gb"] = rest
    return parts


def _gb(value) -> float:
    return float(value) if isinstance(value, (int, float)) and value == value else 0.0


def _figure(unified: dict, row: str, name: str) -> Any:
    return unified.get(row + name)


def run_from_unified(unified: dict, facts: dict, layout: dict) -> Run | None:
    """The run as one logging step's unified dict shows it (per-stage keys, no layers), with the
    run's ``facts`` and ``layout`` (pp/dp sizes, local_world_size); None where activations or the
    per-stage parts were not logged."""
    stages, gpu = [], PREFIX + "peak_reserved_gb" in unified
    for stage in range(int(layout.get("pp_size", 1))):
        row = f"{PREFIX}pp_stage_{stage}/"
        if row + "activations_gb" not in unified or row + "params_gb" not in unified:
            return None
        parts = stage_parts(functools.partial(_figure, unified, row), gpu)
        in_flight = unified.get(row + "microbatches_in_flight")
        stages.append(Stage(stage, parts, int(in_flight) if in_flight is not None else None))
    if gpu:
        capacity = unified.get(PREFIX + "device_total_gb")
    else:
        total = unified.get(PREFIX + "host_limit_gb") or unified.get(PREFIX + "host_total_gb")
        capacity = total / max(int(layout.get("local_world_size", 1)), 1) if total else None
    return Run.of(stages, layout, facts, gpu=gpu, capacity_gb=capacity)


def fix_sentence(run: Run, fraction: float) -> str:
    """The low-headroom warning's advice: the smallest listed change that leaves every stage
    ``fraction`` of its capacity free, with the predicted figure; or that none of them does."""
    found = smallest_fix(run, fraction)
    if found is None:
        return (
            f" No change nemo-memlog advise predicts alone (expandable segments, the distributed optimizer, "
            f"half or a quarter of the micro-batch, full recompute) leaves {fraction:.0%} free on every stage."
        )
    change, outcomes = found
    worst = max(outcomes, key=lambda outcome: outcome.peak_now_gb)
    return (
        f" The smallest listed change that restores it: {change.text} (predicted: stage {worst.stage}'s peak "
        f"{fmt(worst.peak_now_gb)} -> {fmt(worst.peak_gb)} of {fmt(worst.capacity_gb)}; `nemo-memlog advise` "
        f"on the run folder shows every stage)."
    )


def would_have_fit(run: Run) -> list[tuple[str, float]]:
    """(change, predicted peak GB) for each listed change after which every stage fits its capacity."""
    fits = []
    for text in ("expandable_segments=true", "distributed_optimizer=true", "micro_batch_size=x0.5", "recompute=full"):
        try:
            outcomes = predict(run, parse([text]))
        except Refused:
            continue
        if all(outcome.fits for outcome in outcomes):
            fits.append((text, max(outcome.peak_gb for outcome in outcomes)))
    return fits


def oom_run(report: dict, oom: dict, record: dict | None) -> Run | None:
    """The failing rank at a CUDA OOM as a one-stage Run: its breakdown (``report``, from the OOM
    record), the request it could not serve added to its temporaries, the device's limit as the
    capacity; the run's facts and sizes from its per-layer ``record`` where there is one."""
    parts = {name: report.get(name) for name in (*MODEL_STATE, "activations_gb")}
    if any(not isinstance(value, (int, float)) or value != value for value in parts.values()):
        return None
    parts = stage_parts(report.get, gpu=True)
    parts["temporaries_gb"] += (oom.get("bytes_requested") or 0) / 1e9
    record = record or {}
    facts = record.get("run", {})
    in_flight = report.get("microbatches_in_flight")
    stage = Stage(int(record.get("pp_rank", 0)), parts, int(in_flight) if isinstance(in_flight, int) else None)
    limit = oom.get("device_limit")
    return Run.of((stage,), record, facts, gpu=True, capacity_gb=limit / 1e9 if limit else None)
