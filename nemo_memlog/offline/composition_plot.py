"""The report's composition PNG: what each pipeline stage's memory is made of, one stacked bar per
stage, at the run's last logging step, against the device's capacity.

Reads a ``MemoryRun`` (events.py): ``memory/pp_stage_{i}/<part>`` for the parts of PARTS (logged
when the run passed its model to training_log or a callback: composition.py). Draws through
plotting.py (matplotlib, lazily). No torch.
"""

from __future__ import annotations

import math
from pathlib import Path

from .plotting import integer_ticks, new_figure, save

#: (logged name, label, colour), bottom to top: on a GPU they add up to the peak reserved, then
#: the memory outside the allocator.
PARTS = (
    ("params_gb", "parameters", "tab:blue"),
    ("grads_gb", "gradients", "tab:cyan"),
    ("optimizer_state_gb", "optimizer state", "tab:purple"),
    ("activations_gb", "activations", "tab:orange"),
    ("allocator_slack_gb", "allocator slack", "tab:gray"),
    ("device_other_gb", "outside the allocator", "tab:olive"),
)


def has_composition(run) -> bool:
    return bool(run.per_stage("model_state_gb"))


def stage_parts(run) -> tuple[int | None, dict[int, dict[str, float]]]:
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


def write_png(run, path) -> Path:
    """One stacked bar per stage into the PNG at ``path``; returns the path. A part a stage could not
    measure (activations and slack on CPU: no allocator peak) is left out and said so in the legend."""
    step, parts = stage_parts(run)
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
        heights = [0.0 if math.isnan(v) else max(v, 0.0) for v in values]
        axes.bar(stages, heights, bottom=bottoms, color=colour, label=label, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    total = run.get("device_total_gb")
    if total is not None:
        axes.axhline(total.latest, color="red", linestyle=":", label=f"device capacity = {total.latest:.1f} GB")
    for stage, top in zip(stages, bottoms):
        axes.annotate(f"{top:.3g} GB", (stage, top), xytext=(0, 3), textcoords="offset points", ha="center")
    if missing:
        axes.plot([], [], " ", label="not measured (no CUDA allocator):\n" + ", ".join(missing))
    axes.set_xlabel("pipeline stage")
    integer_ticks(axes.xaxis)
    axes.set_ylabel("GB")
    title = f"{run.run_dir.name or run.run_dir}: what each stage's memory is made of, step {step}"
    figure.suptitle(title)
    axes.grid(alpha=0.3, axis="y")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return save(figure, path, title)
