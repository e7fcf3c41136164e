"""The report's composition PNG: what each pipeline stage's memory is made of, one stacked bar per
stage, at the run's last logging step, against the device's capacity.

Reads a ``MemoryRun`` (events.py): ``memory/pp_stage_{i}/<part>`` for the parts of PARTS (logged
when the run passed its model to training_log or a callback: measure/composition.py), and
``microbatches_in_flight``, named under each bar: a stage's activations are that many
microbatches'. In MB when the tallest bar is under 1 GB, else in GB. Draws through plotting.py
(matplotlib, lazily). No torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from .plotting import new_figure, save

if TYPE_CHECKING:
    from .events import MemoryRun

#: (logged name, label, colour), bottom to top: on a GPU they add up to the peak reserved, then
#: the memory outside the allocator. On CPU only the model state and activations are measured.
PARTS = (
    ("params_gb", "parameters", "tab:blue"),
    ("grads_gb", "gradients", "tab:cyan"),
    ("optimizer_state_gb", "optimizer state", "tab:purple"),
    ("activations_gb", "activations", "tab:orange"),
    ("temporaries_gb", "temporaries", "tab:pink"),
    ("allocator_slack_gb", "allocator slack", "tab:gray"),
    ("device_other_gb", "outside the allocator", "tab:olive"),
)
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
            series = run.per_stage(name).get(stage)
            value = math.nan
            if series is not None and step in series.steps:
                value = series.values[series.steps.index(step)]
            parts[stage][name] = value
    return step, parts


def unit(parts: dict[int, dict[str, float]]) -> tuple[str, float]:
    """("MB", 1000) when the tallest stacked bar is under 1 GB, else ("GB", 1)."""
    tallest = max((sum(max(v, 0.0) for v in p.values() if not math.isnan(v)) for p in parts.values()), default=0.0)
    return ("MB", 1000.0) if tallest < 1 else ("GB", 1.0)


def in_flight_labels(run: MemoryRun, step: int) -> dict[int, str]:
    """{stage: "4 in flight"} for each stage that logged its microbatches in flight at ``step``."""
    labels = {}
    for stage, series in run.per_stage(IN_FLIGHT).items():
        value = series.at(step)
        if value is not None and not math.isnan(value):
            labels[stage] = f"{value:.0f} in flight"
    return labels


def write_png(run: MemoryRun, path: str | Path) -> Path:
    """One stacked bar per stage into the PNG at ``path``; returns the path. A part no stage
    measured (temporaries, slack and outside the allocator on CPU: no CUDA allocator) is left out
    and said so in the legend."""
    step, parts = stage_parts(run)
    units, scale = unit(parts)
    figure = new_figure(10, 5.5)
    axes = figure.add_subplot()
    stages = sorted(parts)
    bottoms = [0.0] * len(stages)
    missing = []
    for name, label, colour in PARTS:
        values = [parts[stage][name] for stage in stages]
        if all(math.isnan(v) for v in values):
            missing.append(label)
            continue
        heights = [0.0 if math.isnan(v) else max(v, 0.0) * scale for v in values]
        axes.bar(stages, heights, bottom=bottoms, color=colour, label=label, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    total = run.get("device_total_gb")
    if total is not None:
        capacity = total.latest * scale
        axes.axhline(capacity, color="red", linestyle=":", label=f"device capacity = {capacity:.4g} {units}")
    for stage, top in zip(stages, bottoms):
        axes.annotate(f"{top:.3g} {units}", (stage, top), xytext=(0, 3), textcoords="offset points", ha="center")
    if missing:
        axes.plot([], [], " ", label="not measured here (no CUDA allocator):\n" + ", ".join(missing))
    labels = in_flight_labels(run, step)
    axes.set_xticks(stages, [f"{stage}\n{labels[stage]}" if stage in labels else str(stage) for stage in stages])
    axes.set_xlabel("pipeline stage" + (" (microbatches whose activations it holds)" if labels else ""))
    axes.set_ylabel(units)
    title = f"{run.run_dir.name or run.run_dir}: what each stage's memory is made of, step {step}"
    figure.suptitle(title)
    axes.grid(alpha=0.3, axis="y")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return save(figure, path, title)
