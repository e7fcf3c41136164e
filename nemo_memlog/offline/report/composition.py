"""The report's composition PNG: what each pipeline stage's memory is made of, one stacked bar per
stage up to its measured peak, at the run's last logging step, against the capacity per rank.

Reads a ``MemoryRun`` (events.py): ``memory/pp_stage_{i}/<part>`` for the parts of PARTS (logged
when the run passed its model to training_log or a callback: measure/composition.py), and
``microbatches_in_flight``, named under each bar: a stage's activations are that many
microbatches'. On CPU the bar is topped up to the stage's peak host RSS with the rest of the
process (what the measured parts leave of it), as ``advise`` names it. In MB when the tallest bar
is under 1 GB, else in GB (tables.size_scale). Draws through plotting.py (matplotlib, lazily). No torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import parts as _parts
from ...keys import DEVICE_OTHER as _DEVICE_OTHER
from ...keys import PEAK_HOST_RSS, PEAK_RESERVED
from ...parts import OUTSIDE_CPU, label_of
from ..plotting import PART_COLOURS, new_figure, save
from ..tables import size_scale, size_text

if TYPE_CHECKING:
    from ..events import MemoryRun

#: (logged name, label, colour), bottom to top: on a GPU they add up to the peak reserved, then
#: the memory outside the allocator. On CPU only the model state and activations are measured.
DEVICE_OTHER = _DEVICE_OTHER.key  # the outside part, as logged (parts.OUTSIDE)
TEMPORARIES = _parts.TEMPORARIES.key
PARTS = tuple(
    (key, label_of(key, True), PART_COLOURS[key])
    for key in (*_parts.MODEL_STATE_PARTS, _parts.ACTIVATIONS.key, TEMPORARIES, _parts.ALLOCATOR_SLACK.key)
) + ((DEVICE_OTHER, label_of(DEVICE_OTHER, True), PART_COLOURS[_parts.OUTSIDE.key]),)
#: CPU: the rest of the process's resident memory, up to the stage's peak host RSS (no allocator).
REST = "rest_of_process_gb"
REST_PEAK = PEAK_HOST_RSS.key
#: A capacity more than this many times the tallest bar (a 2 TB node) is named, not drawn.
FAR = 10
IN_FLIGHT = "microbatches_in_flight"


def has_composition(run: MemoryRun) -> bool:
    return bool(run.per_stage("model_state_gb"))


def stage_parts(run: MemoryRun) -> tuple[int | None, dict[int, dict[str, float]]]:
    """(the last step every stage logged the model state at, {stage: {part: GB or NaN}})."""
    model_state = run.per_stage("model_state_gb")
    common = set.intersection(*(set(series.steps) for series in model_state.values())) if model_state else set()
    if not common:
        return None, {}
    step = max(common)
    parts = {}
    for stage in model_state:
        parts[stage] = {}
        for name, _, _ in PARTS:
            parts[stage][name] = _at(run, name, stage, step)
        if all(math.isnan(parts[stage][name]) for name in (TEMPORARIES, DEVICE_OTHER)):
            peak = _at(run, REST_PEAK, stage, step)  # CPU: the rest of the process, up to the peak RSS
            measured = sum(v for v in parts[stage].values() if not math.isnan(v))
            parts[stage][REST] = max(peak - measured, 0.0) if not math.isnan(peak) else math.nan
    return step, parts


def _at(run: MemoryRun, name: str, stage: int, step: int) -> float:
    series = run.per_stage(name).get(stage)
    return series.values[series.steps.index(step)] if series is not None and step in series.steps else math.nan


def unit(parts: dict[int, dict[str, float]]) -> tuple[str, float]:
    """("MB", 1000) when the tallest stacked bar is under 1 GB, else ("GB", 1): the units rule."""
    tallest = max((sum(max(v, 0.0) for v in p.values() if not math.isnan(v)) for p in parts.values()), default=0.0)
    return size_scale(tallest)


def in_flight_labels(run: MemoryRun, step: int) -> dict[int, str]:
    """{stage: "4 in flight"} for each stage that logged its microbatches in flight at ``step``."""
    labels = {}
    for stage, series in run.per_stage(IN_FLIGHT).items():
        value = series.at(step)
        if value is not None and not math.isnan(value):
            labels[stage] = f"{value:.0f} in flight"
    return labels


def write_png(run: MemoryRun, path: str | Path, records: Any = None) -> Path:
    """One stacked bar per stage into the PNG at ``path``, up to the stage's measured peak,
    against the capacity per rank (``records``: the run as its per-layer records say, for the
    host's capacity per rank, as ``report`` and ``advise`` say it); returns the path. A part no
    stage measured (temporaries, slack and outside the allocator on CPU: no CUDA allocator) is
    left out and said so under the legend."""
    from . import capacity_per_rank, replica_line

    step, parts = stage_parts(run)
    gpu = not any(REST in p for p in parts.values())
    found = capacity_per_rank(run, PEAK_RESERVED.key if gpu else REST_PEAK, records)
    units, scale = unit(parts)
    if found is not None and found[0] <= FAR * max(_tops(parts), default=0.0):
        units, scale = size_scale(found[0])  # the capacity on the same axis
    figure = new_figure(10, 5.5)
    axes = figure.add_subplot()
    stages = sorted(parts)
    bottoms = [0.0] * len(stages)
    missing = []
    for name, label, colour in (*PARTS, (REST, OUTSIDE_CPU, "tab:olive")):
        values = [parts[stage].get(name, math.nan) for stage in stages]
        if all(math.isnan(v) for v in values):
            if name != REST and (gpu or name != DEVICE_OTHER):  # CPU: the rest of the process has it
                missing.append(label)
            continue
        heights = [0.0 if math.isnan(v) else max(v, 0.0) * scale for v in values]
        axes.bar(stages, heights, bottom=bottoms, color=colour, label=label, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for stage, top in zip(stages, bottoms):
        axes.annotate(size_text(top / scale), (stage, top), xytext=(0, 3), textcoords="offset points", ha="center")
    top_of_bars = max(bottoms, default=0.0)
    if found is not None:
        capacity, label = found
        if capacity * scale > FAR * top_of_bars > 0:
            axes.set_ylim(top=1.15 * top_of_bars)
            axes.text(0.01, 0.98, f"{label}: above this scale", transform=axes.transAxes, va="top", fontsize="small")
        else:
            axes.axhline(capacity * scale, color="red", linestyle=":", label=label)
    if missing:
        axes.plot([], [], " ", label="not measured here (no CUDA allocator):\n" + ", ".join(missing))
    labels = in_flight_labels(run, step)
    axes.set_xticks(stages, [f"{stage}\n{labels[stage]}" if stage in labels else str(stage) for stage in stages])
    axes.set_xlabel("pipeline stage" + (" (microbatches whose activations it holds)" if labels else ""))
    axes.set_ylabel(units)
    peak = "peak reserved + outside the allocator" if gpu else "peak host RSS"
    title = f"{run.run_dir.name or run.run_dir}: what each stage's memory is made of, step {step}, up to its {peak}"
    figure.suptitle(title + "\n" + replica_line(run, records))
    axes.grid(alpha=0.3, axis="y")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return save(figure, path, title + "; " + replica_line(run, records))


def _tops(parts: dict[int, dict[str, float]]) -> list[float]:
    return [sum(max(v, 0.0) for v in p.values() if not math.isnan(v)) for p in parts.values()]
