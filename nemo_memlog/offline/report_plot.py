"""The report's PNG: one metric's per-stage values over steps, the logged max, the capacity.

matplotlib is imported here, lazily, with the Agg backend: no display is needed.
"""

from __future__ import annotations

from pathlib import Path

from .report import MemoryRun, capacity_tag


def write_png(run: MemoryRun, metric: str, path) -> Path:
    """Draw ``metric`` for every stage of ``run`` into the PNG at ``path``; returns the path.

    One line per pipeline stage (memory/pp_stage_{i}/<metric>), the logged pipeline-wide
    max (memory/<metric>) dashed, and the capacity (device or host total) as a horizontal line.
    The title (also the PNG's Title text) names the run's peak window (memory_peak_window).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 5.5), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    for stage, series in run.per_stage(metric).items():
        axes.plot(series.steps, series.values, marker="o", markersize=3, linewidth=1.5, label=f"stage {stage}")
    logged = run.get(metric)
    if logged is not None:
        axes.plot(logged.steps, logged.values, linestyle="--", color="black", linewidth=1.2,
                  label="logged max over stages")
    _capacity_line(axes, run, metric)
    if metric.endswith("_gb"):
        axes.set_ylim(bottom=0)  # distance to the capacity line reads as headroom
    axes.set_xlabel("step")
    axes.set_ylabel(_unit_label(metric))
    title = f"{metric} per pipeline stage, peak window: {run.peak_window or 'not recorded'}"
    axes.set_title(f"{title}  ({run.run_dir.name or run.run_dir})")
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")  # never over the lines
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, metadata={"Title": title})  # the PNG's own text says what it shows
    return path


def _capacity_line(axes, run: MemoryRun, metric: str) -> None:
    """The capacity as a horizontal line; when it is far above the data (a 2 TB node, 20 GB
    of RSS) the y axis stays on the data, so the stages stay apart, and the legend says so."""
    capacity = run.get(capacity_tag(metric))
    if capacity is None:
        return
    label = f"{capacity_tag(metric)} = {capacity.latest:.2f}"
    top = max((v for line in axes.get_lines() for v in line.get_ydata() if v == v), default=0.0)
    far = top > 0 and capacity.latest > 3 * top
    axes.axhline(capacity.latest, color="red", linestyle=":", linewidth=1.5,
                 label=label + (" (above this scale)" if far else ""))
    if far:
        axes.set_ylim(top=1.15 * top)


def _unit_label(metric: str) -> str:
    if metric.endswith("_gb"):
        return f"{metric} (GB)"
    if metric.endswith("_pct"):
        return f"{metric} (%)"
    return metric
