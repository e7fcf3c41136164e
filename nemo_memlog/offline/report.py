"""Read a run's TensorBoard events back into memory series, and render the per-stage table.

Works on a run directory copied off a cluster: no training code, no torch, no
torch.distributed; tensorboard is imported only when events are read. The tags read
are those attribution.py writes:

    memory/<name>                   max over stages         -> "logged max" columns
    memory/peak_stage/<name>        stage holding that max  -> "stage" column
    memory/peak_rank/<name>         (scope "world") rank    -> shown next to the stage
    memory/pp_stage_{i}/<name>      stage i's own value     -> one column pair per stage
    memory/headroom_gb, _stage      device headroom         -> "headroom" on device rows
    memory/host_headroom_gb, _stage host headroom           -> "headroom" on host rows

and the run config the TensorBoard writer records as text, for ``memory_peak_window``:
whether each ``peak_*`` point is the peak of the run so far or of its logging interval.
Every other tag (loss, lr, ...) is ignored.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path

from ..attribution import PREFIX

EVENT_GLOB = "events.out.tfevents.*"
TABLE_WIDTH = 118
_STAGE_LABEL = re.compile(r"pp_stage_(\d+)")
_EXPECTED = (f"expected TensorBoard event files ({EVENT_GLOB}) written with logger.tensorboard_dir "
             "(and logger.log_memory_to_tensorboard=true)")


class ReportError(Exception):
    """The run directory cannot be reported on; the message says why and what was expected."""


@dataclass(frozen=True)
class Series:
    """One tag's points, sorted by step (one value per step)."""

    steps: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def latest(self) -> float:
        return self.values[-1]

    @property
    def peak(self) -> float:
        """The max over steps, NaN points left out (all NaN: NaN)."""
        return max((v for v in self.values if v == v), default=float("nan"))

    @property
    def peak_step(self) -> int:
        """The first step at which the peak was reached."""
        peak = self.peak
        return next((s for s, v in zip(self.steps, self.values) if v == peak), self.steps[-1])

    def at(self, step: int) -> float | None:
        return dict(zip(self.steps, self.values)).get(step)


@dataclass(frozen=True)
class EventFile:
    """One event file's memory points (tag -> step -> (wall_time, value)) and recorded configs."""

    path: Path
    points: dict[str, dict[int, tuple[float, float]]]
    configs: list[tuple[float, str]]

    @property
    def first_step(self) -> int:
        return min(step for by_step in self.points.values() for step in by_step)

    @property
    def last_step(self) -> int:
        return max(step for by_step in self.points.values() for step in by_step)

    @property
    def started(self) -> float:
        """Wall time of its first memory point."""
        return min(wall for by_step in self.points.values() for wall, _ in by_step.values())

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"steps {self.first_step}..{self.last_step}, started {started}: {self.path}"


@dataclass
class MemoryRun:
    """The ``memory/`` series of one run, keyed by the tag without its prefix."""

    run_dir: Path
    series: dict[str, Series]
    skipped: list[str] = field(default_factory=list)  # "file: reason" for unreadable event files
    peak_window: str | None = None  # memory_peak_window from the recorded config; None: not recorded
    files: list[EventFile] = field(default_factory=list)  # this run's event files, oldest first
    other_runs: list[list[EventFile]] = field(default_factory=list)  # other runs found, not reported

    def get(self, tag: str) -> Series | None:
        return self.series.get(tag)

    @property
    def resumed_at(self) -> list[int]:
        """The first step of each event file that continued this run (a resume), in order."""
        return [part.first_step for part in self.files[1:]]

    def per_stage(self, name: str) -> dict[int, Series]:
        """Stage index -> that stage's own series of ``name`` (empty if not logged per stage)."""
        found = {}
        for tag, series in self.series.items():
            label, _, key = tag.partition("/")
            match = _STAGE_LABEL.fullmatch(label)
            if match and key == name:
                found[int(match.group(1))] = series
        return dict(sorted(found.items()))

    @property
    def stages(self) -> list[int]:
        labels = (_STAGE_LABEL.fullmatch(tag.partition("/")[0]) for tag in self.series)
        return sorted({int(m.group(1)) for m in labels if m})

    @property
    def steps(self) -> list[int]:
        return sorted({step for series in self.series.values() for step in series.steps})

    def metrics(self) -> list[str]:
        """Names that have per-stage values or a peak stage: the table's rows."""
        names = {tag.partition("/")[2] for tag in self.series
                 if tag.startswith("peak_stage/") or _STAGE_LABEL.fullmatch(tag.partition("/")[0])}
        return sorted(names, key=lambda name: (_is_host(name), not name.startswith("peak_"), name))


def load_run(run_dir) -> MemoryRun:
    """The newest run's ``memory/`` scalars in the event files under ``run_dir`` (a folder,
    searched recursively, or one event file).

    Each event file is read on its own, so files from several writers or restarts never
    purge each other's points. Files are split into runs by ``split_runs``; the newest run
    is reported, the others are listed in ``other_runs``, never stitched in. Within a run,
    where two files hold the same tag and step (a resume from a checkpoint before the last
    logged step), the point written last (wall time) wins. Raises ReportError for a missing
    path, one without event files, or events without memory metrics.
    """
    run_dir = Path(run_dir)
    if run_dir.is_file():
        files = [run_dir]
    elif run_dir.is_dir():
        files = sorted(path for path in run_dir.rglob(EVENT_GLOB) if path.is_file())
    else:
        raise ReportError(f"{run_dir}: no such directory; {_EXPECTED}")
    if not files:
        raise ReportError(f"{run_dir}: no TensorBoard event files found under it; {_EXPECTED}")
    read, skipped = [], []
    for path in files:
        try:
            points, configs = _read_event_file(path)
        except Exception as error:  # one corrupt file must not hide the others
            skipped.append(f"{path}: {type(error).__name__}: {error}")
            continue
        if points:  # a file without memory points (a run stopped before its first logging step) adds nothing
            read.append(EventFile(path, points, configs))
    if not read:
        raise ReportError(f"{run_dir}: {len(files)} event file(s) but no {PREFIX}* metrics in them; {_EXPECTED}")
    *others, newest = split_runs(read)
    merged: dict[str, dict[int, tuple[float, float]]] = {}
    for part in newest:
        for tag, by_step in part.points.items():
            into = merged.setdefault(tag, {})
            for step, (wall_time, value) in by_step.items():
                if step not in into or wall_time >= into[step][0]:
                    into[step] = (wall_time, value)
    series = {}
    for tag, by_step in merged.items():
        steps = tuple(sorted(by_step))
        series[tag.removeprefix(PREFIX)] = Series(steps, tuple(by_step[s][1] for s in steps))
    configs = [config for part in newest for config in part.configs]
    return MemoryRun(run_dir, series, skipped, _peak_window(configs), newest, others)


def split_runs(files: list[EventFile]) -> list[list[EventFile]]:
    """Event files grouped into runs, oldest run first, each run's files oldest first.

    Taken in the order they started, a file continues the run before it (a resume from a
    checkpoint) when its first logged step comes after that run's first step, and starts a
    new run when it starts over, at or before that step: a second job written into the same
    folder, however its steps overlap the first's. (A new job whose first logged step is later
    than the old one's, as with a larger logging interval, cannot be told from a resume by
    the steps; give each run its own folder.)"""
    runs: list[list[EventFile]] = []
    for part in sorted(files, key=lambda part: part.started):
        if runs and part.first_step > runs[-1][0].first_step:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def _peak_window(configs: list[tuple[float, str]]) -> str | None:
    """memory_peak_window from one run's recorded configs, oldest first; "a -> b" when a
    resume changed it; None when no config was recorded. A config without the field was
    written before the option existed, when every peak was the run's."""
    from ..writers.tensorboard import params_from_text

    windows = []
    for _, text in sorted(configs):
        try:
            params = params_from_text(text)
        except ValueError:  # not a config this library wrote
            continue
        if not isinstance(params, dict):
            continue
        window = str(params.get("logger.memory_peak_window", params.get("memory_peak_window", "run")))
        if not windows or windows[-1] != window:
            windows.append(window)
    return " -> ".join(windows) or None


def _read_event_file(path: Path) -> tuple[dict[str, dict[int, tuple[float, float]]], list[tuple[float, str]]]:
    """One event file: step -> (wall_time, value) per memory tag, old- and new-style scalars
    (the last point written wins within the file); and (wall_time, text) of each run config
    recorded in it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    from ..writers.tensorboard import CONFIG_TENSOR_TAG

    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    configs = []
    if CONFIG_TENSOR_TAG in tags.get("tensors", []):
        configs = [(e.wall_time, e.tensor_proto.string_val[0].decode("utf-8", "replace"))
                   for e in accumulator.Tensors(CONFIG_TENSOR_TAG) if e.tensor_proto.string_val]
    out = {}
    for tag in tags.get("scalars", []):
        if tag.startswith(PREFIX):
            out[tag] = [(e.wall_time, e.step, float(e.value)) for e in accumulator.Scalars(tag)]
    for tag in tags.get("tensors", []):  # SummaryWriter.add_scalar(new_style=True) writes tensors
        if tag.startswith(PREFIX) and tag not in out:
            values = [(e.wall_time, e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)]
            out[tag] = [(w, s, float(v)) for w, s, v in values if v.size == 1]
    points = {}
    for tag, triples in out.items():
        by_step = points.setdefault(tag, {})
        for wall_time, step, value in triples:
            if step not in by_step or wall_time >= by_step[step][0]:
                by_step[step] = (wall_time, value)
    return points, configs


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
    raise ReportError(f"{run.run_dir}: no per-stage memory metrics to plot; {_EXPECTED}")


def _is_host(name: str) -> bool:
    return "host" in name


def capacity_tag(name: str) -> str:
    """The capacity a metric is measured against: the node's RAM for host metrics, else the device."""
    return "host_total_gb" if _is_host(name) else "device_total_gb"


def format_value(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name.endswith("_pct"):
        return f"{value:.1f}"
    if name.endswith("_gb"):
        return f"{value:.2f}"
    if float(value).is_integer():  # counters (alloc_retries) and stage indices
        return str(int(value))
    return f"{value:.3g}"


# ---- the table ---------------------------------------------------------------------------


@dataclass
class Column:
    group: str  # spanning header over consecutive columns with the same group
    header: str
    cells: list[str]
    left: bool = False

    @property
    def width(self) -> int:
        return max(len(self.header), *(len(c) for c in self.cells)) if self.cells else len(self.header)


def format_report(run: MemoryRun) -> str:
    """The header lines and the per-stage table, wrapped to TABLE_WIDTH columns."""
    steps = run.steps
    last = steps[-1]
    lines = [f"run: {run.run_dir}",
             f"steps {steps[0]}..{last} ({len(steps)} logged); pipeline stages: {len(run.stages)}; "
             f"now = step {last}, peak = max over steps; GB unless the name says otherwise"]
    lines.append(peak_window_line(run))
    lines += runs_lines(run)
    capacity = [f"{label} {format_value(tag, run.get(tag).latest)} GB"
                for label, tag in (("device", "device_total_gb"), ("host", "host_total_gb")) if run.get(tag)]
    if capacity:
        lines.append("capacity (largest stage): " + ", ".join(capacity))
    names = run.metrics()
    if not names:
        return "\n".join(lines + ["no per-stage memory metrics logged"])
    lines.append("")
    lines += _render(_columns(run, names), TABLE_WIDTH)
    lines += [f"skipped unreadable event file {entry}" for entry in run.skipped]
    return "\n".join(lines)


_WINDOW_MEANING = {
    "run": "each peak_* point is the peak since its process started",
    "interval": "each peak_* point is the peak since the previous logged step",
}


def peak_window_line(run: MemoryRun) -> str:
    """Which window the run's peak_* values cover (logger.memory_peak_window), in words."""
    if run.peak_window is None:
        return "peak window: not recorded (no run config in the events; nemo_memlog's default is run)"
    meaning = _WINDOW_MEANING.get(run.peak_window, "changed when the run was resumed")
    return f"peak window: {run.peak_window} ({meaning})"


def runs_lines(run: MemoryRun) -> list[str]:
    """Where the run resumed, and the other runs found under RUN_DIR that were left out."""
    lines = [f"resumed at step {step} (event file {part.path.name} continues the run)"
             for step, part in zip(run.resumed_at, run.files[1:])]
    if run.other_runs:
        lines.append(f"NOTE: {run.run_dir} holds {len(run.other_runs) + 1} runs (event files whose steps "
                     f"start over); this report shows only the newest, "
                     f"{run.files[0].describe().split(': ')[0]}. Not included:")
        lines += [f"  {part.describe()}" for other in run.other_runs for part in other]
        lines.append("  to report one of them, pass its event file (or a folder holding only its run) as RUN_DIR")
    return lines


def _columns(run: MemoryRun, names: list[str]) -> list[Column]:
    logged = [run.get(name) for name in names]
    columns = [Column("", "metric", names, left=True),
               Column("logged max", "now", [format_value(n, s and s.latest) for n, s in zip(names, logged)]),
               Column("logged max", "peak", [format_value(n, s and s.peak) for n, s in zip(names, logged)]),
               Column("logged max", "stage", [_holder(run, name) for name in names])]
    for stage in run.stages:
        per_stage = [run.per_stage(name).get(stage) for name in names]
        columns.append(Column(f"stage {stage}", "now", [format_value(n, s and s.latest) for n, s in zip(names, per_stage)]))
        columns.append(Column(f"stage {stage}", "peak", [format_value(n, s and s.peak) for n, s in zip(names, per_stage)]))
    headroom = [_headroom(run, "host_headroom" if _is_host(name) else "headroom") for name in names]
    columns.append(Column("headroom", "GB now", [gb for gb, _ in headroom]))
    columns.append(Column("headroom", "stage", [stage for _, stage in headroom]))
    return columns


def _holder(run: MemoryRun, name: str) -> str:
    """The stage holding the logged max at the step of its overall max (and its rank, scope "world")."""
    logged = run.get(name)
    where = run.get(f"peak_stage/{name}")
    if logged is None or where is None:
        return "-"
    stage = where.at(logged.peak_step)
    rank = run.get(f"peak_rank/{name}")
    rank = rank and rank.at(logged.peak_step)
    text = format_value("peak_stage", stage)
    return text if rank is None else f"{text} (r{int(rank)})"


def _headroom(run: MemoryRun, prefix: str) -> tuple[str, str]:
    gb, stage = run.get(f"{prefix}_gb"), run.get(f"{prefix}_stage")
    return format_value("headroom_gb", gb and gb.latest), format_value("headroom_stage", stage and stage.latest)


def _render(columns: list[Column], width: int) -> list[str]:
    """Aligned text; groups that do not fit in ``width`` continue below, the first column repeated."""
    first, *rest = columns
    blocks = [[]]
    for _, group in groupby(rest, key=lambda column: column.group):
        group = list(group)
        if blocks[-1] and _block_width([first, *blocks[-1], *group]) > width:
            blocks.append([])
        blocks[-1] += group
    lines = []
    for block in blocks:
        lines += ([""] if lines else []) + _render_block([first, *block])
    return lines


def _block_width(columns: list[Column]) -> int:
    groups = len([1 for _ in groupby(columns, key=lambda column: column.group)])
    return sum(column.width for column in columns) + 2 * (len(columns) - 1) + (groups - 1)


def _render_block(columns: list[Column]) -> list[str]:
    """Group line, header line, rule, rows. Two spaces between columns, three between groups."""
    def row(texts):
        parts = []
        for i, (column, text) in enumerate(zip(columns, texts)):
            if i:
                parts.append("   " if columns[i - 1].group != column.group else "  ")
            parts.append(text.ljust(column.width) if column.left else text.rjust(column.width))
        return "".join(parts).rstrip()

    spans = [list(span) for _, span in groupby(columns, key=lambda column: column.group)]
    groups = "   ".join(span[0].group.center(sum(c.width for c in span) + 2 * (len(span) - 1)) for span in spans)
    header = row([column.header for column in columns])
    return [groups.rstrip(), header, "-" * len(header), *(row(cells) for cells in zip(*(c.cells for c in columns)))]
