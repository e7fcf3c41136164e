"""`nemo-memlog report`: the per-stage memory table of a run, from its TensorBoard events.

Reads the run through events.py (``load_run``); ``format_report`` returns the text the
command prints: the run's steps, peak window, resumes and other runs, capacities, and one
row per memory metric with the logged max, the stage holding it, each stage's own values
and the headroom. report_plot.py draws the PNG. No torch.
"""

from __future__ import annotations

from ..attribution import PREFIX
from .events import EXPECTED, EventFile, MemoryRun, ReportError, Series, is_host, load_run, split_runs
from .tables import Column, metric_cell, render_table

__all__ = [
    "EventFile",
    "MemoryRun",
    "ReportError",
    "Series",
    "TABLE_WIDTH",
    "capacity_tag",
    "choose_metric",
    "format_report",
    "load_run",
    "peak_window_line",
    "runs_lines",
    "split_runs",
]

TABLE_WIDTH = 118
_WINDOW_MEANING = {
    "run": "each peak_* point is the peak since its process started",
    "interval": "each peak_* point is the peak since the previous logged step",
}


def choose_metric(run: MemoryRun, metric: str | None = None) -> str:
    """The per-stage metric to plot: ``metric`` if given, else peak_reserved_gb, else peak_host_rss_gb."""
    available = [name for name in run.metrics() if run.per_stage(name) or run.get(name)]
    if metric is not None:
        name = metric.removeprefix(PREFIX)
        if name not in available:
            raise ReportError(f"{run.run_dir}: no metric {metric!r}; available: {', '.join(available) or 'none'}")
        return name
    for name in ("peak_reserved_gb", "peak_host_rss_gb", *available):
        if name in available:
            return name
    raise ReportError(f"{run.run_dir}: no per-stage memory metrics to plot; {EXPECTED}")


def capacity_tag(name: str) -> str:
    """The capacity a metric is measured against: the node's RAM for host metrics, else the device."""
    return "host_total_gb" if is_host(name) else "device_total_gb"


def format_report(run: MemoryRun) -> str:
    """The header lines and the per-stage table, wrapped to TABLE_WIDTH columns."""
    steps = run.steps
    last = steps[-1]
    lines = [
        f"run: {run.run_dir}",
        f"steps {steps[0]}..{last} ({len(steps)} logged); pipeline stages: {len(run.stages)}; "
        f"now = step {last}, peak = max over steps; GB unless the name says otherwise",
    ]
    lines.append(peak_window_line(run))
    lines += runs_lines(run)
    capacity = [
        f"{label} {metric_cell(tag, run.get(tag).latest)} GB"
        for label, tag in (("device", "device_total_gb"), ("host", "host_total_gb"))
        if run.get(tag)
    ]
    if capacity:
        lines.append("capacity (largest stage): " + ", ".join(capacity))
    names = run.metrics()
    if not names:
        return "\n".join(lines + ["no per-stage memory metrics logged"])
    lines.append("")
    lines += render_table(_columns(run, names), TABLE_WIDTH)
    lines += [f"skipped unreadable event file {entry}" for entry in run.skipped]
    return "\n".join(lines)


def peak_window_line(run: MemoryRun) -> str:
    """Which window the run's peak_* values cover (logger.memory_peak_window), in words."""
    if run.peak_window is None:
        return "peak window: not recorded (no run config in the events; nemo_memlog's default is run)"
    meaning = _WINDOW_MEANING.get(run.peak_window, "changed when the run was resumed")
    return f"peak window: {run.peak_window} ({meaning})"


def runs_lines(run: MemoryRun) -> list[str]:
    """Where the run resumed, and the other runs found under RUN_DIR that were left out."""
    lines = [
        f"resumed at step {step} (event file {part.path.name} continues the run)"
        for step, part in zip(run.resumed_at, run.files[1:])
    ]
    if run.other_runs:
        lines.append(
            f"NOTE: {run.run_dir} holds {len(run.other_runs) + 1} runs (event files whose steps "
            f"start over); this report shows only the newest, "
            f"{run.files[0].describe().split(': ')[0]}. Not included:"
        )
        lines += [f"  {part.describe()}" for other in run.other_runs for part in other]
        lines.append("  to report one of them, pass its event file (or a folder holding only its run) as RUN_DIR")
    return lines


def _columns(run: MemoryRun, names: list[str]) -> list[Column]:
    """metric | logged max: now, peak, stage | per stage: now, peak | headroom: GB now, stage."""
    columns = [
        Column("", "metric", names, left=True),
        *_now_and_peak("logged max", names, map(run.get, names)),
        Column("logged max", "stage", [_holder(run, name) for name in names]),
    ]
    for stage in run.stages:
        columns += _now_and_peak(f"stage {stage}", names, (run.per_stage(name).get(stage) for name in names))
    headroom = [_headroom(run, "host_headroom" if is_host(name) else "headroom") for name in names]
    columns.append(Column("headroom", "GB now", [gb for gb, _ in headroom]))
    columns.append(Column("headroom", "stage", [stage for _, stage in headroom]))
    return columns


def _now_and_peak(group: str, names: list[str], series) -> list[Column]:
    """The "now" (latest) and "peak" columns of one series per name ("-" where None)."""
    series = list(series)
    return [
        Column(group, "now", [metric_cell(n, s and s.latest) for n, s in zip(names, series)]),
        Column(group, "peak", [metric_cell(n, s and s.peak) for n, s in zip(names, series)]),
    ]


def _holder(run: MemoryRun, name: str) -> str:
    """The stage holding the logged max at the step of its overall max (and its rank, scope "world")."""
    logged = run.get(name)
    where = run.get(f"peak_stage/{name}")
    if logged is None or where is None:
        return "-"
    stage = where.at(logged.peak_step)
    rank = run.get(f"peak_rank/{name}")
    rank = rank and rank.at(logged.peak_step)
    text = metric_cell("peak_stage", stage)
    return text if rank is None else f"{text} (r{int(rank)})"


def _headroom(run: MemoryRun, prefix: str) -> tuple[str, str]:
    gb, stage = run.get(f"{prefix}_gb"), run.get(f"{prefix}_stage")
    return metric_cell("headroom_gb", gb and gb.latest), metric_cell("headroom_stage", stage and stage.latest)
