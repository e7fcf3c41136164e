"""The per-stage charts drawn at close (W&B, MLflow, Comet): readable at any pipeline size, cheap
to draw, and never past the close budget.

``chart_lines`` picks what a chart shows, the same for every backend. Up to ``MANY_STAGES``
stages: the max and every stage. Beyond: the max, the median of the stages, their range (min to
max, a band) and the ``TOP_STAGES`` stages with the highest peak, so a legend has at most
``TOP_STAGES + 3`` entries however deep the pipeline. Every line is cut to at most
``LINE_POINTS`` points, each keeping its bucket's highest value at its own step, so a peak
survives the cut (a band keeps each bucket's lowest and highest).

``log_figures`` draws one chart at a time (a plain matplotlib ``Figure``: no pyplot, no GUI
backend, no layout engine), hands it to the backend, and before each one checks the time left:
what would not finish before ``deadline`` less the backend's reserve (to end its run) is skipped
and said once, with how many and why. No backend library is imported here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..warn import notice
from .stages import MAX_LINE, PREFIX, StageHistory

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Above this many stages a chart draws the max, the median, the range and the top stages only.
MANY_STAGES = 10
#: The stages drawn by name beyond MANY_STAGES: those with the highest peak.
TOP_STAGES = 5
#: The most points a drawn line keeps.
LINE_POINTS = 1000
MEDIAN_LINE = "median of stages"
MIN_LINE = "min of stages"
RANGE_BAND = "range of stages (min-max)"
#: What the first chart is assumed to take before one has been timed (seconds).
FIRST_CHART_S = 2.0


@dataclass(frozen=True)
class ChartLine:
    """One legend entry: a line (``kind`` "max", "median" or "stage"), or the band of the
    stages' range (``kind`` "range": ``values`` its low edge, ``high`` its high edge)."""

    label: str
    kind: str
    steps: list
    values: list
    high: list | None = None


def bucket_max(steps: list, values: list, points: int = LINE_POINTS) -> tuple[list, list]:
    """At most ``points`` of (steps, values): per bucket of neighbouring points, the highest, at its step."""
    if len(steps) <= points:
        return list(steps), list(values)
    size = -(-len(steps) // points)
    kept_steps, kept_values = [], []
    for start in range(0, len(steps), size):
        bucket = range(start, min(start + size, len(steps)))
        top = max(bucket, key=values.__getitem__)
        kept_steps.append(steps[top])
        kept_values.append(values[top])
    return kept_steps, kept_values


def _bucket_range(steps: list, low: list, high: list, points: int) -> tuple[list, list, list]:
    size = max(1, -(-len(steps) // points))
    cut = range(0, len(steps), size)
    return (
        [steps[i] for i in cut],
        [min(low[i : i + size]) for i in cut],
        [max(high[i : i + size]) for i in cut],
    )


def chart_lines(
    history: StageHistory, tag: str, many: int = MANY_STAGES, top: int = TOP_STAGES, points: int = LINE_POINTS
) -> list[ChartLine]:
    """What the chart of ``tag`` draws, legend order: the max, then (at most ``many`` stages) every
    stage, or (more) the median, the range and the ``top`` stages by peak. Never mutates ``history``."""
    lines = {label: line for label, line in history.lines(tag).items() if line[0]}
    stages = {label: line for label, line in lines.items() if label != MAX_LINE}
    out = []
    if MAX_LINE in lines:
        out.append(ChartLine(MAX_LINE, "max", *bucket_max(*lines[MAX_LINE], points)))
    if len(stages) <= many:
        return out + [ChartLine(label, "stage", *bucket_max(*line, points)) for label, line in stages.items()]
    steps, low, middle, high = _across_stages(stages)
    out.append(ChartLine(MEDIAN_LINE, "median", *bucket_max(steps, middle, points)))
    band_steps, band_low, band_high = _bucket_range(steps, low, high, points)
    out.append(ChartLine(RANGE_BAND, "range", band_steps, band_low, band_high))
    highest = sorted(stages, key=lambda label: -max(stages[label][1]))[:top]
    return out + [ChartLine(label, "stage", *bucket_max(*stages[label], points)) for label in highest]


def _across_stages(stages: dict) -> tuple[list, list, list, list]:
    """(steps, min, median, max) over the stages with a value at each step."""
    at: dict = {}
    for steps, values in stages.values():
        for step, value in zip(steps, values):
            at.setdefault(step, []).append(value)
    steps = sorted(at)
    return (
        steps,
        [min(at[step]) for step in steps],
        [statistics.median(at[step]) for step in steps],
        [max(at[step]) for step in steps],
    )


def as_series(lines: list[ChartLine]) -> dict[str, tuple[list, list]]:
    """``{label: (steps, values)}`` for a chart of lines only (W&B's): a band as its low edge, ``MIN_LINE``."""
    return {(MIN_LINE if line.kind == "range" else line.label): (line.steps, line.values) for line in lines}


def title(tag: str, lines: list[ChartLine]) -> str:
    if any(line.kind == "range" for line in lines):
        return f"{tag}: the max, the stages' median and range, and the highest stages"
    return f"{tag}: every pipeline stage, and their max"


def draw(tag: str, lines: list[ChartLine]) -> Figure:
    """A matplotlib Figure of ``lines`` with their legend beside the axes (the ``report`` extra)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 4.5), dpi=100)
    figure.subplots_adjust(left=0.08, right=0.74, top=0.9, bottom=0.12)
    axes = figure.add_subplot()
    colours = iter(f"C{i}" for i in range(10))
    for line in lines:
        if line.kind == "max":
            axes.plot(line.steps, line.values, label=line.label, color="black", linestyle="--", lw=2.5, alpha=0.6)
        elif line.kind == "median":
            axes.plot(line.steps, line.values, label=line.label, color="dimgray", linewidth=2)
        elif line.kind == "range":
            axes.fill_between(line.steps, line.values, line.high, label=line.label, color="gray", alpha=0.25)
        else:
            axes.plot(line.steps, line.values, label=line.label, linewidth=1.5, color=next(colours, None))
    axes.set_title(title(tag, lines), fontsize="medium")
    axes.set_xlabel("step")
    axes.set_ylabel(tag.removeprefix(PREFIX))
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return figure


def log_figures(
    history: StageHistory,
    log_figure: Callable[[str, object], None],
    deadline: float,
    *,
    who: str,
    where: str,
) -> int:
    """``log_figure(tag, figure)`` per chart of ``history``, while the next one can end before
    ``deadline`` (time.monotonic()); the rest skipped, said once in a notice naming ``who`` and
    ``where`` the lines are kept as data. Returns how many were logged; without matplotlib, 0."""
    try:
        import matplotlib.figure  # noqa: F401 -- the report extra
    except ImportError:
        return 0
    tags = sorted(history.charts)
    slowest = FIRST_CHART_S
    for done, tag in enumerate(tags):
        if time.monotonic() + slowest > deadline:
            notice(
                f"nemo_memlog: {who}: {len(tags) - done} of the {len(tags)} per-stage charts were not drawn: "
                f"the close budget (logger.writer_close_timeout_s) would have run out; their lines are in {where}"
            )
            return done
        started = time.monotonic()
        log_figure(tag, draw(tag, chart_lines(history, tag)))
        slowest = max(time.monotonic() - started, slowest if done else 0.0)
    return len(tags)
