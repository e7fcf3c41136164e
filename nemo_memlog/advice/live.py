"""The advice read from a run as it logs (a logging step's gathered values, the low-headroom
warning) and at a CUDA OOM (the post-mortem's one-stage run)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from ..attribution import GatheredMemory, low_headroom, stage_value
from ..keys import DEVICE_OTHER, DEVICE_TOTAL, HOST_LIMIT, HOST_TOTAL, PEAK_HOST_RSS, PEAK_RESERVED
from ..parts import ACTIVATIONS, ALLOCATOR_SLACK, IN_FLIGHT, OUTSIDE, PARAMS, TEMPORARIES
from .model import MODEL_STATE, Profile, Stage, fmt, parse
from .predict import Refused, max_micro_batch_size, predict, smallest_fix

# ---- live: from a logging step's gathered values ----------------------------------------------

#: The dashboard's one advice scalar: the largest micro-batch size predicted to fit on every stage.
MAX_MICRO_BATCH = "memory/advice/max_micro_batch_size"


def stage_parts(figure: Callable[[str], Any], gpu: bool) -> dict:
    """One stage's parts (``parts.ADVISED_KEYS``) from its figures as measured.

    GPU: temporaries, slack and the memory outside the allocator as measured. CPU: the rest of the
    process's peak resident memory, split where its idle size was measured (``host_idle_rss_gb``)
    into ``outside_gb`` (idle, beyond the model state) and ``temporaries_gb`` (the working set of
    the microbatch computed at the peak), else all ``outside_gb``.

    Args:
        figure: a figure's value by its name, or None; absent or NaN counts as 0.
        gpu: whether the stage measured a CUDA device.
    """
    parts = {name: _gb(figure(name)) for name in (*MODEL_STATE, ACTIVATIONS.key)}
    if gpu:
        parts[TEMPORARIES.key] = _gb(figure(TEMPORARIES.key))
        parts[ALLOCATOR_SLACK.key] = _gb(figure(ALLOCATOR_SLACK.key))
        parts[OUTSIDE.key] = _gb(figure(DEVICE_OTHER.key))
    else:
        rest = max(_gb(figure(PEAK_HOST_RSS.key)) - sum(parts.values()), 0.0)
        idle = _gb(figure("host_idle_rss_gb"))
        if idle:  # the idle size beyond the model state stays; what the microbatch adds grows with it
            outside = min(max(idle - sum(parts[name] for name in MODEL_STATE), 0.0), rest)
            parts[TEMPORARIES.key] = rest - outside
            parts[OUTSIDE.key] = outside
        else:
            parts[OUTSIDE.key] = rest
    return parts


def _gb(value) -> float:
    return float(value) if isinstance(value, (int, float)) and value == value else 0.0


def run_from_gathered(
    gathered: GatheredMemory, facts: dict, layout: dict, *, stage_of: Sequence[int] | None = None
) -> Profile | None:
    """The run as one logging step gathered it: each stage's parts, whatever is logged per stage.

    Args:
        gathered: the step's values, every rank's, lined up (``attribution.GatheredMemory``).
        facts: the run's facts (micro-batch size, microbatches, ...).
        layout: the job's sizes (``pp_size``, ``dp_size``, ``local_world_size``).
        stage_of: with every rank gathered (the world scope), the pipeline stage of each position;
            a stage's figure is then the largest over its ranks.

    Returns:
        The ``Profile``, or None where a stage has no measured activations or parameters.
    """
    maximum = gathered.maximum
    stages, gpu = [], PEAK_RESERVED.key in maximum
    for stage in range(int(layout.get("pp_size", 1))):
        figures = functools.partial(stage_value, gathered, stage, stage_of=stage_of)
        if figures(ACTIVATIONS.key) is None or figures(PARAMS.key) is None:
            return None
        in_flight = figures(IN_FLIGHT.key)
        stages.append(Stage(stage, stage_parts(figures, gpu), int(in_flight) if in_flight is not None else None))
    if gpu:
        capacity = maximum.get(DEVICE_TOTAL.key)
    else:
        total = maximum.get(HOST_LIMIT.key) or maximum.get(HOST_TOTAL.key)
        capacity = total / max(int(layout.get("local_world_size", 1)), 1) if total else None
    return Profile.of(stages, layout, facts, gpu=gpu, capacity_gb=capacity)


def step_metrics(profile: Profile | None) -> dict:
    """The advice a logging step logs: ``MAX_MICRO_BATCH`` where the run states its micro-batch size."""
    if profile is None or not profile.micro_batch_size:
        return {}
    best, _ = max_micro_batch_size(profile)
    return {} if best is None else {MAX_MICRO_BATCH: best}


def headroom_warnings(unified: dict, fraction: float, profile: Profile | None) -> list[tuple[str, str]]:
    """(kind, sentence) for each headroom below ``fraction`` of capacity (``attribution.low_headroom``),
    with the smallest change that would restore it where ``run`` measured that kind of memory."""
    found = []
    for kind, _stage, sentence in low_headroom(unified, fraction):
        if profile is not None and (kind == "device") == profile.gpu:
            sentence += fix_sentence(profile, fraction)
        found.append((kind, sentence))
    return found


def fix_sentence(profile: Profile, fraction: float) -> str:
    """The low-headroom warning's advice: the smallest listed change that leaves every stage
    ``fraction`` of its capacity free, with the predicted figure; or that none of them does."""
    found = smallest_fix(profile, fraction)
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


def would_have_fit(profile: Profile) -> list[tuple[str, float]]:
    """(change, predicted peak GB) for each listed change after which every stage fits its capacity."""
    fits = []
    for text in ("expandable_segments=true", "distributed_optimizer=true", "micro_batch_size=x0.5", "recompute=full"):
        try:
            outcomes = predict(profile, parse([text]))
        except Refused:
            continue
        if all(outcome.fits for outcome in outcomes):
            fits.append((text, max(outcome.peak_gb for outcome in outcomes)))
    return fits


def oom_run(report: dict, oom: dict, record: dict | None) -> Profile | None:
    """The failing rank at a CUDA OOM as a one-stage Profile: its breakdown (``report``, from the OOM
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
    return Profile.of((stage,), record, facts, gpu=True, capacity_gb=limit / 1e9 if limit else None)
