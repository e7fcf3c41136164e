"""The post-mortem's PNG: the last records per pipeline stage, and when each rank stopped.

Reads a ``postmortem.Postmortem`` (and the rings of the few ranks it draws); draws one PNG
through plotting.py (matplotlib, lazily, on the Agg backend).
"""

from __future__ import annotations

from pathlib import Path

from .plotting import finish_axes, integer_ticks, new_figure, save
from .postmortem_state import Postmortem, RankState
from .tables import finite_number

METRICS = ("peak_reserved_gb", "peak_host_rss_gb", "host_rss_gb")
_STATUS_COLOR = {"closed": "tab:green", "cuda_oom": "tab:red", "unfinished": "tab:orange"}


def write_png(postmortem: Postmortem, path: str | Path) -> Path:
    """Two panels into the PNG at ``path``; returns the path.

    Top: per pipeline stage, the records still in the ring of the rank holding the stage's
    highest memory metric (peak_reserved_gb, else host RSS) in its last record; the first
    failure's own records in red, its last point (the OOM, or its last record) marked. Bottom, only
    when there is a failure: each rank's stop (``failure_time``, as the table's "stopped" columns)
    relative to the first failure, coloured by status, the ranks that died of its loss apart, the
    first failure starred.
    """
    first = postmortem.first_failure
    failed = first is not None and first.failure_time is not None
    figure = new_figure(11, 8 if failed else 4.5)
    top, bottom = figure.subplots(2, 1) if failed else (figure.subplots(1, 1), None)
    metric = _metric(postmortem.ranks)
    _stage_lines(top, postmortem.ranks, metric, first)
    if failed:  # on a clean run the stop times differ by noise: nothing to show
        _stop_times(bottom, postmortem, first)
    folder = postmortem.run_dir.resolve()
    named = f"{folder.parent.name}/{folder.name}" if folder.name == "memory_records" else folder.name
    title = f"post-mortem of {named or folder}: " + (
        f"first failure rank {first.rank} ({first.status})" if first else "no failure"
    )
    figure.suptitle(title)
    return save(figure, path, title)


def _metric(ranks: list[RankState]) -> str:
    """The first of METRICS in the ranks' last reports."""
    for metric in METRICS:
        if any(state.value(metric) is not None for state in ranks):
            return metric
    return METRICS[0]


def _series(state: RankState, metric: str) -> list[tuple[int, float]]:
    """(iteration, value) of ``metric`` in the rank's readable records, by iteration (parses its ring)."""
    points = {}
    for record in state.file.records:
        value = finite_number((record.get("report") or {}).get(metric))
        if isinstance(record.get("iteration"), int) and value is not None:
            points[record["iteration"]] = value
    return sorted(points.items())


def _stage_lines(axes, ranks: list[RankState], metric: str, first: RankState | None) -> None:
    """Per stage, the records of the rank with the stage's highest ``metric`` in its last report:
    its ring is parsed, the other ranks' are not (4,096 ranks would cost seconds)."""
    holders: dict = {}
    for state in ranks:
        value = state.value(metric)
        stage = state.header.get("pp_rank")
        if value is not None and (stage not in holders or value > holders[stage].value(metric)):
            holders[stage] = state
    for stage in sorted(holders, key=str):
        points = _series(holders[stage], metric)
        if points:
            axes.plot(
                *zip(*points),
                marker="o",
                markersize=3,
                linewidth=1.2,
                label=f"stage {stage}: rank {holders[stage].rank}, the stage's highest {metric}",
            )
    if first is not None:
        points = _series(first, metric)
        if points:
            axes.plot(*zip(*points), color="red", linewidth=2.5, label=f"rank {first.rank} (first failure)")
            axes.plot(*points[-1], marker="X", markersize=14, color="red", linestyle="none")
    axes.set_xlabel("iteration (records still in the rings)")
    integer_ticks(axes.xaxis)
    axes.set_ylabel(f"{metric} (GB)")
    axes.set_ylim(bottom=0)
    finish_axes(axes)


def _stop_times(axes, postmortem: Postmortem, first: RankState) -> None:
    """Each rank's failure (or last-alive) time, relative to the first failure's, coloured by status."""
    zero = first.failure_time
    stopped = [s for s in postmortem.ranks if s.failure_time is not None]
    groups = [
        (f"{status} ({{}})", color, [s for s in stopped if s.status == status and s.died_of is None])
        for status, color in _STATUS_COLOR.items()
    ]
    groups.append((f"died of rank {first.rank}'s loss ({{}})", "tab:gray", [s for s in stopped if s.died_of]))
    for label, color, group in groups:
        if group:
            axes.scatter(
                [s.rank for s in group],
                [s.failure_time - zero for s in group],
                s=12,
                color=color,
                label=label.format(len(group)),
            )
    axes.scatter(
        [first.rank],
        [0.0],
        s=250,
        marker="*",
        color="red",
        edgecolor="black",
        zorder=3,
        label=f"first failure: rank {first.rank}",
    )
    axes.set_xlabel("rank")
    integer_ticks(axes.xaxis)
    axes.set_ylabel("stopped (s after the first failure)")
    finish_axes(axes)
