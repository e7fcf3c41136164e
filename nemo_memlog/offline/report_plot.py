"""The report's PNG: one metric's per-stage values over steps, the logged max, the capacity.

Reads a ``MemoryRun`` (events.py); draws one PNG through plotting.py (matplotlib, lazily,
on the Agg backend: no display is needed).
"""

from __future__ import annotations

from pathlib import Path

from .plotting import finish_axes, new_figure, save
from .report import MemoryRun, capacity_tag
from .tables import unit


def write_png(run: MemoryRun, metric: str, path) -> Path:
    """Draw ``metric`` for every stage of ``run`` into the PNG at ``path``; returns the path.

    One line per pipeline stage (memory/pp_stage_{i}/<metric>), the logged pipeline-wide
    max (memory/<metric>) dashed, and the capacity (device or host total) as a horizontal line.
    The title (also the PNG's Title text) names the run's peak window (memory_peak_window).
    """
    figure = new_figure(10, 5.5)
    axes = figure.add_subplot()
    for stage, series in run.per_stage(metric).items():
        axes.plot(series.steps, series.values, marker="o", markersize=3, linewidth=1.5, label=f"stage {stage}")
    logged = run.get(metric)
    if logged is not None:
        axes.plot(
            logged.steps, logged.values, linestyle="--", color="black", linewidth=1.2, label="logged max over stages"
        )
    _capacity_line(axes, run, metric)
    if unit(metric) == "GB":
        axes.set_ylim(bottom=0)  # distance to the capacity line reads as headroom
    axes.set_xlabel("step")
    axes.set_ylabel(metric if unit(metric) is None else f"{metric} ({unit(metric)})")
    title = f"{metric} per pipeline stage, peak window: {run.peak_window or 'not recorded'}"
    axes.set_title(f"{title}  ({run.run_dir.name or run.run_dir})")
    finish_axes(axes)
    return save(figure, path, title)  # the PNG's own text says what it shows


def _capacity_line(axes, run: MemoryRun, metric: str) -> None:
    """The capacity as a horizontal line; when it is far above the data (a 2 TB node, 20 GB
    of RSS) the y axis stays on the data, so the stages stay apart, and the legend says so."""
    capacity = run.get(capacity_tag(metric))
    if capacity is None:
        return
    label = f"{capacity_tag(metric)} = {capacity.latest:.2f}"
    top = max((v for line in axes.get_lines() for v in line.get_ydata() if v == v), default=0.0)
    far = top > 0 and capacity.latest > 3 * top
    axes.axhline(
        capacity.latest, color="red", linestyle=":", linewidth=1.5, label=label + (" (above this scale)" if far else "")
    )
    if far:
        axes.set_ylim(top=1.15 * top)
