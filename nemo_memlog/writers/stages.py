"""The per-stage series of a step, as the dashboards overlay them: one chart per metric, one
line per pipeline stage, and the pipeline-wide max beside them.

The unified dict holds ``memory/<name>`` (the max over stages) and ``memory/pp_stage_{i}/<name>``
(stage i's own value, for the names matching ``memory_per_stage_keys``). ``stage_values`` splits
a step's per-stage keys into (stage label, shared tag, value); ``StageHistory`` keeps, per
metric, the steps and each line's values, for the backends that draw a chart of the whole run
when it closes (W&B, MLflow, Comet; charts.py draws them). A run with a single stage has nothing to overlay: its
stage's line is the max. No backend library is imported here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

PREFIX = "memory/"
_PER_STAGE = re.compile(r"memory/(pp_stage_(\d+))/(.+)")
#: A stage's label, also the folder of its own TensorBoard run (``<tensorboard_dir>/pp_stage_{i}``,
#: or ``pp_stage_{i}-2`` .. when that name is taken by something else: writers/tensorboard.py).
STAGE_LABEL = re.compile(r"pp_stage_\d+(-\d+)?")
#: The line of the pipeline-wide max in a chart.
MAX_LINE = "max"
#: The points each chart keeps: past twice this, every other step is dropped (the run's whole span stays).
MAX_POINTS = 1000


def stage_values(metrics: dict) -> Iterator[tuple[str, str, float]]:
    """(stage label, shared tag, value) for each ``memory/pp_stage_{i}/<name>`` of ``metrics``:
    ``("pp_stage_1", "memory/<name>", value)``; the shared tag is the max's."""
    for key, value in metrics.items():
        match = _PER_STAGE.fullmatch(key)
        if match:
            yield match.group(1), PREFIX + match.group(3), value


def stage_order(label: str) -> tuple[int, str]:
    """Sort key: the max first, then stages by number."""
    match = _PER_STAGE.fullmatch(f"memory/{label}/x")
    return (int(match.group(2)), label) if match else (-1, label)


class StageHistory:
    """Per shared tag (``memory/<name>`` logged per stage): the steps, and each line's value at
    them (``None`` where a line has no value at that step). Kept only once two stages have been
    seen; thinned to at most ``2 * max_points`` steps per chart."""

    def __init__(self, max_points: int = MAX_POINTS):
        self.max_points = max_points
        self.stages: set[str] = set()
        self.charts: dict[str, dict[int, dict[str, float]]] = {}  # tag -> step -> line -> value
        self._stride: dict[str, int] = {}  # tag -> keep every n-th step offered
        self._offered: dict[str, int] = {}  # tag -> steps offered so far
        self._lines: dict[str, dict] = {}  # tag -> lines(tag), until the next add (a close reads each twice)

    def add(self, metrics: dict, step: int) -> None:
        found = list(stage_values(metrics))
        if not found:
            return
        self.stages |= {label for label, _, _ in found}
        self._lines.clear()
        if len(self.stages) < 2:
            return
        by_tag: dict[str, dict[str, float]] = {}
        for label, tag, value in found:
            by_tag.setdefault(tag, {})[label] = value
        for tag, values in by_tag.items():
            rows = self.charts.setdefault(tag, {})
            if step not in rows:
                offered = self._offered.get(tag, 0)
                self._offered[tag] = offered + 1
                if offered % self._stride.get(tag, 1):
                    continue  # thinned: every stride-th step offered is kept
                rows[step] = {}
                if len(rows) > 2 * self.max_points:
                    self._thin(tag)
                    if step not in rows:
                        continue
            if tag in metrics:
                rows[step][MAX_LINE] = metrics[tag]
            rows[step].update(values)

    def _thin(self, tag: str) -> None:
        """Keep every other step held, and from now on every other step kept (the first step stays)."""
        self._stride[tag] = self._stride.get(tag, 1) * 2
        rows = self.charts[tag]
        for step in sorted(rows)[1::2]:
            del rows[step]

    def lines(self, tag: str) -> dict[str, tuple[list[int], list[float]]]:
        """``{line: (steps, values)}`` of one chart, the max first then the stages in order;
        points whose value is not a finite number are left out (a chart cannot draw them).
        The caller must not mutate what it gets: it is kept until the next ``add``."""
        if tag not in self._lines:
            self._lines[tag] = self._read_lines(tag)
        return self._lines[tag]

    def _read_lines(self, tag: str) -> dict[str, tuple[list[int], list[float]]]:
        rows = self.charts.get(tag, {})
        out: dict[str, tuple[list[int], list[float]]] = {}
        for step, row in sorted(rows.items()):  # one pass over the rows, whatever the number of lines
            for label, value in row.items():
                value = float(value)
                if math.isfinite(value):
                    steps, values = out.setdefault(label, ([], []))
                    steps.append(step)
                    values.append(value)
        labels = sorted({label for row in rows.values() for label in row}, key=stage_order)
        return {label: out.get(label, ([], [])) for label in labels}

    def as_dict(self) -> dict:
        """Every chart as plain data: ``{tag: {line: {"steps": [...], "values": [...]}}}``."""
        return {
            tag: {label: {"steps": steps, "values": values} for label, (steps, values) in self.lines(tag).items()}
            for tag in sorted(self.charts)
        }


def artifact_name(tag: str) -> str:
    """``memory/peak_reserved_gb`` -> ``peak_reserved_gb`` (a file name: ``/`` -> ``__``)."""
    return tag.removeprefix(PREFIX).replace("/", "__")
