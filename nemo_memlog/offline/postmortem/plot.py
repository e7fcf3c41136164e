"""The post-mortem's PNG: the last records per pipeline stage, and when each rank stopped.

Reads a ``postmortem.Postmortem`` (and the rings of the few ranks it draws); draws one PNG
through plotting.py (matplotlib, lazily, on the Agg backend).
"""

from __future__ import annotations

from pathlib import Path

from ...keys import HOST_RSS, PEAK_HOST_RSS, PEAK_RESERVED
from ..plotting import finish_axes, integer_ticks, new_figure, save
from ..tables import finite_number, size_scale, size_text
from .state import Postmortem, RankState

METRICS = (PEAK_RESERVED.key, PEAK_HOST_RSS.key, HOST_RSS.key)
_STATUS_COLOR = {"closed": "tab:green", "cuda_oom": "tab:red", "unfinished": "tab:orange"}
#: One colour per stage, none of them red or grey (the first failure is marked, not coloured).
STAGE_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def write_png(postmortem: Postmortem, path: str | Path) -> Path:
    """Two panels into the PNG at ``path``; returns the path.

    Top: per pipeline stage, the records still in the ring of the rank holding the stage's
    highest memory metric (peak_reserved_gb, else host RSS) in its last record, one distinct colour
    per stage; the first failure's last point (the OOM, or its last record) marked with a black X and
    named beside it, its own records dashed in black when another rank holds its stage. Bottom, only
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
    lines = {stage: _series(holders[stage], metric) for stage in holders}
    if first is not None:
        lines["first"] = _series(first, metric)
    tallest = max((v for points in lines.values() for _, v in points), default=0.0)
    units, scale = size_scale(tallest)
    for i, stage in enumerate(sorted(holders, key=str)):
        points = lines[stage]
        if points:
            holder = holders[stage]
            dp = holder.header.get("dp_rank")
            axes.plot(
                [it for it, _ in points],
                [scale * v for _, v in points],
                marker="o",
                markersize=3,
                linewidth=1.5,
                color=STAGE_COLOURS[i % len(STAGE_COLOURS)],
                label=f"stage {stage}: rank {holder.rank}" + (f" (dp {dp})" if dp is not None else ""),
            )
    if first is not None and lines["first"]:
        points = lines["first"]
        if all(first is not holder for holder in holders.values()):  # its stage's line is another rank's
            axes.plot(
                [it for it, _ in points],
                [scale * v for _, v in points],
                color="black",
                linestyle="--",
                linewidth=1.2,
                label=f"rank {first.rank} (first failure), stage {first.header.get('pp_rank')}",
            )
        it, value = points[-1]
        axes.plot(
            it,
            scale * value,
            marker="X",
            markersize=13,
            markerfacecolor="none",
            markeredgecolor="black",
            markeredgewidth=2,
            linestyle="none",
            zorder=4,
            label=f"first failure: rank {first.rank} ({first.status}), its last record",
        )
        axes.annotate(
            f"first failure: rank {first.rank}, stage {first.header.get('pp_rank')}\n"
            f"{size_text(value)} at iteration {it}",
            (it, scale * value),
            xytext=(-14, 6),
            textcoords="offset points",
            ha="right",
            va="bottom",
            fontsize="small",
        )
    axes.set_xlabel("iteration (records still in the rings)")
    integer_ticks(axes.xaxis)
    axes.set_ylabel(f"{metric} ({units})")
    axes.set_ylim(bottom=0, top=1.18 * scale * tallest if tallest > 0 else None)
    axes.set_title(
        f"per stage: the rank with the stage's highest {metric} in its last record (which replica: its dp)",
        fontsize="small",
    )
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
