"""The report's PNG: one metric's per-stage values over steps, the logged max, the capacity.

Reads a ``MemoryRun`` (events.py); draws one PNG through plotting.py (matplotlib, lazily,
on the Agg backend: no display is needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..plotting import finish_axes, integer_ticks, new_figure, save
from ..tables import size_scale, size_text, unit
from . import MemoryRun, capacity_per_rank, replica_line


def write_png(run: MemoryRun, metric: str, path: str | Path, records: Any = None) -> Path:
    """Draw ``metric`` for every stage of ``run`` into the PNG at ``path``; returns the path.

    One line per pipeline stage (memory/pp_stage_{i}/<metric>) over a wide grey band, the logged
    pipeline-wide max (memory/<metric>), so no stage hides under it; the last stage marked as what
    stock Megatron dashboards show (their writer is the last rank), with the gap from it to the
    peak at the last step labelled where it exceeds what the stages vary by over the run; the
    capacity (per rank, as the report says it) as a horizontal line, or a note when it is far above
    the data. Sizes by the units rule (MB below 1 GB). The title (also the PNG's Title text) names
    the run folder, the peak window and whose values the stages are (which replica).
    """
    figure = new_figure(10, 5.5)
    axes = figure.add_subplot()
    stages = run.per_stage(metric)
    last = max(stages, default=None)
    logged = run.get(metric)
    sized = unit(metric) == "GB"
    everything = [v for s in [*stages.values(), *([logged] if logged else [])] for v in s.values if v == v]
    units, scale = size_scale(max(everything, default=0.0)) if sized else (unit(metric), 1.0)
    if logged is not None:  # under the stage lines: a band, never a line that hides one
        axes.plot(
            logged.steps,
            [scale * v for v in logged.values],
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
            [scale * v for v in series.values],
            marker="o",
            markersize=3,
            linewidth=2.2 if stock else 1.5,
            linestyle="--" if stock else "-",
            zorder=2,
            label=f"stage {stage} (last: what Megatron-LM, Bridge < 0.5 log)" if stock else f"stage {stage}",
        )
    if len(stages) > 1:
        _gap_label(axes, stages, last, metric, scale)
    if sized:
        axes.set_ylim(bottom=0)  # distance to the capacity line reads as headroom
    _capacity_line(axes, run, metric, records, scale, units)
    if not axes.get_xlabel():  # the capacity's note may be there already
        axes.set_xlabel("step")
    integer_ticks(axes.xaxis)
    axes.set_ylabel(axis_label(metric, units))
    window = run.peak_window or "not recorded"
    title = f"{run.run_dir.name or run.run_dir}: {metric} per pipeline stage, peak window: {window}"
    figure.suptitle(
        title + "\n" + replica_line(run, records)
    )  # over the whole figure: the legend beside the axes leaves them narrow
    finish_axes(axes)
    return save(figure, path, title + "; " + replica_line(run, records))  # the PNG's own text says what it shows


def axis_label(metric: str, units: str | None) -> str:
    """The y axis's name, its unit said once: ``peak_host_rss (MB)``, not ``peak_host_rss_gb (MB)``
    (a size is drawn in MB below 1 GB, whatever its name's unit); ``None``: the name alone."""
    if units is None:
        return metric
    return f"{metric.removesuffix('_gb').removesuffix('_pct')} ({units})"


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


def spread(series: Any) -> float:
    """How much one stage's values vary over the run's steps (max - min): the run's own noise."""
    values = [v for v in series.values if v == v]
    return max(values) - min(values) if values else 0.0


def _gap_label(axes, stages: dict, last, metric: str, scale: float = 1.0) -> None:
    """An arrow from the last stage up to the peak at the last common step, with the gap in words;
    only where the gap exceeds how much those two stages vary over the run's steps (else it is
    noise, and a grey note says the stages are level)."""
    found = gap_to_last_stage(stages, last)
    if found is None:
        return
    step, peak, shown, peak_stage = found
    if peak <= shown:
        _note(axes, "the last stage holds the peak here: last-rank dashboards show it")
        return
    gap = peak - shown
    noise = max(spread(stages[peak_stage]), spread(stages[last]))
    sized = unit(metric) == "GB"
    size = size_text(gap) if sized else f"{gap:.3g}"
    varies = size_text(noise) if sized else f"{noise:.3g}"
    if gap <= noise:
        _note(axes, f"stages level: the gap ({size}) is within what a stage varies over the run ({varies})")
        return
    share = f" (+{100 * gap / shown:.0f}%)" if shown > 0 else ""
    axes.annotate(
        "",
        xy=(step, scale * peak),
        xytext=(step, scale * shown),
        arrowprops={"arrowstyle": "<->", "color": "tab:red", "lw": 1.5},
    )
    _note(
        axes,
        f"<-> +{size}{share} on stage {peak_stage} at step {step}: hidden from last-rank dashboards\n"
        f"(stages vary by at most {varies} over the run)",
        "tab:red",
    )


def _note(axes, text: str, color: str = "dimgray") -> None:
    """``text`` above the axes, at their left: a note never lies over the lines (the layout makes room
    for it, as for the legend beside the axes)."""
    axes.set_title(text, loc="left", fontsize="small", color=color)


def _capacity_line(axes, run: MemoryRun, metric: str, records=None, scale: float = 1.0, units=None) -> None:
    """The capacity as a horizontal line with its source in the legend; when it is far above the
    data (a 2 TB node, 20 GB of RSS) the y axis stays on the data, so the stages stay apart, and
    no line is drawn: a note in the corner says where it is (no legend entry for what is not drawn)."""
    found = capacity_per_rank(run, metric, records)
    if found is None:
        return
    capacity, label = found
    top = max((v for line in axes.get_lines() for v in line.get_ydata() if v == v), default=0.0)
    if top > 0 and scale * capacity > 3 * top:
        axes.set_ylim(top=1.15 * top)
        # Under the step axis: the gap's note takes the space above the axes.
        axes.set_xlabel(f"step\n{label.replace(chr(10), ' ')}: above this scale", color="dimgray", fontsize="small")
        return
    axes.axhline(scale * capacity, color="red", linestyle=":", linewidth=1.5, label=label)
