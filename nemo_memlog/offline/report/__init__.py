"""`nemo-memlog report`: the per-stage memory table of a run, from its TensorBoard events.

Reads the run through events.py (``load_run``); ``format_report`` returns the text the
command prints: the run's steps, peak window, resumes and other runs, capacities, and one
row per memory metric with the logged max, the stage holding it, each stage's own values
and the headroom. No torch. Beside it:

- ``plot``: the PNG of one metric's per-stage values over steps, the logged max, the capacity;
- ``composition``: the PNG of what each stage's memory is made of, at the last logging step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...attribution import PREFIX
from ...keys import DEVICE_TOTAL, HEADROOM, HEADROOM_STAGE, HOST_HEADROOM, HOST_TOTAL, PEAK_HOST_RSS, PEAK_RESERVED
from ..events import EXPECTED, EventFile, MemoryRun, ReportError, Series, is_host, load_run, split_runs
from ..tables import Column, metric_cell, printable, render_table, size_text

__all__ = [
    "EventFile",
    "MemoryRun",
    "ReportError",
    "Series",
    "TABLE_WIDTH",
    "capacity_tag",
    "capacity_lines",
    "records_run",
    "replica_line",
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
    for name in (PEAK_RESERVED.key, PEAK_HOST_RSS.key, *available):
        if name in available:
            return name
    raise ReportError(f"{run.run_dir}: no per-stage memory metrics to plot; {EXPECTED}")


def capacity_tag(name: str) -> str:
    """The capacity a metric is measured against: the node's RAM for host metrics, else the device."""
    return HOST_TOTAL.key if is_host(name) else DEVICE_TOTAL.key


_UNREAD = object()


def format_report(run: MemoryRun, records: Any = _UNREAD) -> str:
    """The header lines and the per-stage table, wrapped to TABLE_WIDTH columns. ``records``: the
    run as its per-layer records say (``records_run``), read here when not given."""
    steps = run.steps
    last = steps[-1]
    lines = [
        f"run: {run.run_dir}",
        f"steps {steps[0]}..{last} ({len(steps)} logged); pipeline stages: {len(run.stages)}; "
        f"now = step {last}, peak = max over steps; sizes in MB below 1 GB, else GB",
    ]
    lines.append(peak_window_line(run))
    lines += runs_lines(run)
    records = records_run(run) if records is _UNREAD else records
    lines.append(replica_line(run, records))
    lines += capacity_lines(run, records)
    names = run.metrics()
    if not names:
        return "\n".join(map(printable, lines + ["no per-stage memory metrics logged"]))
    lines.append("")
    lines += render_table(_columns(run, names), TABLE_WIDTH)
    lines += [f"skipped unreadable event file {entry}" for entry in run.skipped]
    return "\n".join(map(printable, lines))  # an event file's tags and names cannot forge a line


def records_run(run: MemoryRun, folder: Path | None = None, budget: Any = None) -> Any:
    """The run as ``advise`` reads it from its per-layer records (an ``advice.Profile``), or None
    without readable records: the report takes the capacity per rank and the layout from it,
    so both commands say the same. ``folder``: the records' folder, given (``report --records``)
    where it is not the run's: unreadable, it raises ReportError saying why. ``budget``: the
    command's read budget (bounded.ReadBudget)."""
    from ..advise import AdviseError, load

    try:
        return load(run.run_dir if folder is None else folder, budget=budget)
    except (AdviseError, OSError, ValueError, TypeError, KeyError) as error:
        if folder is None:
            return None
        raise ReportError(f"--records {folder}: {error}") from None


def replica_line(run: MemoryRun, records: Any = None) -> str:
    """Whose values the stage columns are: the writer rank's pipeline group (one data-parallel
    replica), or with memory_reduce_scope=world each stage's max over every replica."""
    scope = run.reduce_scope or "pp"
    dp = f" of DP {records.dp_size}" if records is not None else ""
    if records is not None and records.dp_size <= 1:
        return "per-stage values: the only data-parallel replica (DP 1)"
    if scope == "world":
        return f"per-stage values: each stage's max over its ranks in every data-parallel replica{dp} (scope world)"
    return (
        f"per-stage values: the writer's data-parallel replica{dp} (rank world_size-1's pipeline group); "
        "all: scope world"
    )


def capacity_per_rank(run: MemoryRun, metric: str, records: Any = None) -> tuple[float, str] | None:
    """(GB, label) of the capacity a PNG draws for ``metric``: per rank as ``capacity_lines`` says
    it (the records' capacity for a host metric on CPU), else the logged device or host total."""
    if records is not None and records.capacity_gb and is_host(metric) != records.gpu:
        return records.capacity_gb, f"capacity per rank {size_text(records.capacity_gb)}\n({records.capacity_source})"
    total = run.get(capacity_tag(metric))
    if total is None:
        return None
    where = "host memory on this node (all its ranks)" if is_host(metric) else "the device's total memory"
    return total.latest, f"capacity {size_text(total.latest)}\n({where})"


def capacity_lines(run: MemoryRun, records: Any = None) -> list[str]:
    """The capacity once, and where it came from: per rank as ``advise`` takes it (from the
    per-layer records: the host memory shared by the node's ranks, or the device), and why the
    host headroom column differs from it (the node's free memory now, shared by its ranks)."""
    lines = []
    device, host = run.get(DEVICE_TOTAL.key), run.get(HOST_TOTAL.key)
    per_rank_host = records is not None and bool(records.capacity_gb) and not records.gpu
    if records is not None and records.capacity_gb:
        from ..advise import capacity_line

        lines.append(capacity_line(records) + ", as `nemo-memlog advise` takes it")
        peaks = run.per_stage(PEAK_HOST_RSS.key) if per_rank_host else {}
        if per_rank_host and records.nodes:  # ranks sharing a cgroup: its charge, shared pages once
            node = min(records.nodes, key=lambda node: node.limit_gb - node.charge_gb)
            lines.append(
                f"least headroom: {size_text(node.limit_gb - node.charge_gb)} under the memory cgroup limit "
                f"{size_text(node.limit_gb)} of {len(node.stages)} ranks (its peak charge {size_text(node.charge_gb)}, "
                "shared pages once)"
            )
        elif peaks:
            stage, series = max(peaks.items(), key=lambda item: (item[1].latest, -item[0]))
            lines.append(
                f"least headroom per rank: {size_text(records.capacity_gb - series.latest)} on stage {stage} "
                f"(capacity per rank - its peak_host_rss {size_text(series.latest)})"
            )
    elif device is not None:
        lines.append(f"capacity per rank: {size_text(device.latest)} (the device's total memory)")
    if host is not None and not per_rank_host:
        lines.append(
            f"host memory: {size_text(host.latest)} on this node, shared by its ranks (how many: the per-layer "
            "records say; `advise` divides it)"
        )
    if host is not None and run.get(HOST_HEADROOM.key) is not None:
        lines.append(
            "headroom column (host): the node's MemAvailable (or cgroup room) now, least over stages: "
            "free to any rank, not per rank"
        )
    return lines


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
    columns.append(Column("headroom", "now", [gb for gb, _ in headroom]))
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
    return metric_cell(HEADROOM.key, gb and gb.latest), metric_cell(HEADROOM_STAGE.key, stage and stage.latest)
