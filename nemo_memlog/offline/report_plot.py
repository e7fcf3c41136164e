"""The report's PNG: one metric's per-stage values over steps, the logged max, the capacity.

Reads a ``MemoryRun`` (events.py); draws one PNG through plotting.py (matplotlib, lazily,
on the Agg backend: no display is needed).
"""

from __future__ import annotations

from pathlib import Path

from .plotting import finish_axes, integer_ticks, new_figure, save
from .report import MemoryRun, capacity_tag
from .tables import unit


def write_png(run: MemoryRun, metric: str, path: str | Path) -> Path:
    """Draw ``metric`` for every stage of ``run`` into the PNG at ``path``; returns the path.

    One line per pipeline stage (memory/pp_stage_{i}/<metric>) over a wide grey band, the logged
    pipeline-wide max (memory/<metric>), so no stage hides under it; the last stage marked as what
    stock Megatron dashboards show (their writer is the last rank), with the gap from it to the
    peak at the last step labelled; the capacity (device or host total) as a horizontal line.
    The title (also the PNG's Title text) names the run folder and the peak window.
    """
    figure = new_figure(10, 5.5)
    axes = figure.add_subplot()
    stages = run.per_stage(metric)
    last = max(stages, default=None)
    logged = run.get(metric)
    if logged is not None:  # under the stage lines: a band, never a line that hides one
        axes.plot(
            logged.steps,
            logged.values,
            color="black",
            alpha=0.15,
            linewidth=9,
            solid_capstyle="round",
            zorder=1,
            label=f"logged max over stages (memory/{metric})",
        )
    for stage, series in stages.items():
        stock = stage == last and len(stages) > 1
        axes.plot(
            series.steps,
            series.values,
            marker="o",
            markersize=3,
            linewidth=2.2 if stock else 1.5,
            linestyle="--" if stock else "-",
            zorder=2,
            label=f"stage {stage} (last: what Megatron-LM, Bridge < 0.5 log)" if stock else f"stage {stage}",
        )
    if len(stages) > 1:
        _gap_label(axes, stages, last, metric)
    _capacity_line(axes, run, metric)
    if unit(metric) == "GB":
        axes.set_ylim(bottom=0)  # distance to the capacity line reads as headroom
    axes.set_xlabel("step")
    integer_ticks(axes.xaxis)
    axes.set_ylabel(metric if unit(metric) is None else f"{metric} ({unit(metric)})")
    window = run.peak_window or "not recorded"
    title = f"{run.run_dir.name or run.run_dir}: {metric} per pipeline stage, peak window: {window}"
    figure.suptitle(title)  # over the whole figure: the legend beside the axes leaves them narrow
    finish_axes(axes)
    return save(figure, path, title)  # the PNG's own text says what it shows


def gap_to_last_stage(stages: dict, last: int) -> tuple[int, float, float, object] | None:
    """(step, peak over stages, last stage's value, the peak's stage) at the last step every stage
    logged; None without one. What stock dashboards (the last stage) miss of the peak there."""
    common = set.intersection(*(set(series.steps) for series in stages.values()))
    if not common:
        return None
    step = max(common)
    values = {stage: series.values[series.steps.index(step)] for stage, series in stages.items()}
    peak_stage = max(values, key=lambda stage: (values[stage], -stage))
    return step, values[peak_stage], values[last], peak_stage


def _gap_label(axes, stages: dict, last, metric: str) -> None:
    """An arrow from the last stage up to the peak at the last common step, with the gap in words."""
    found = gap_to_last_stage(stages, last)
    if found is None:
        return
    step, peak, shown, peak_stage = found
    if peak <= shown:
        text = "the last stage holds the peak here: last-rank dashboards show it"
        axes.annotate(text, (step, shown), xytext=(-10, 12), textcoords="offset points", ha="right", fontsize="small")
        return
    gap = peak - shown
    size = (
        f"+{gap * 1000:.0f} MB"
        if unit(metric) == "GB" and gap < 1
        else f"+{gap:.2f}{' GB' if unit(metric) == 'GB' else ''}"
    )
    share = f" (+{100 * gap / shown:.0f}%)" if shown > 0 else ""
    axes.annotate(
        "", xy=(step, peak), xytext=(step, shown), arrowprops={"arrowstyle": "<->", "color": "tab:red", "lw": 1.5}
    )
    axes.annotate(
        f"{size}{share} on stage {peak_stage}:\nhidden from last-rank dashboards",
        (step, (peak + shown) / 2),
        xytext=(-8, 0),
        textcoords="offset points",
        ha="right",
        va="center",
        color="tab:red",
        fontsize="small",
    )


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
