"""Read a run's TensorBoard event files back into memory series, one ``MemoryRun``.

Reads the event files under a run directory (copied off a cluster or not); prints nothing.
No training code, no torch, no torch.distributed; tensorboard is imported only when events
are read. The tags read are those attribution.py writes:

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

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..attribution import PREFIX
from .tables import date_time

EVENT_GLOB = "events.out.tfevents.*"
#: What a run directory must hold, said at the end of every "cannot report" message.
EXPECTED = (
    f"expected TensorBoard event files ({EVENT_GLOB}) written with logger.tensorboard_dir "
    "(and logger.log_memory_to_tensorboard=true)"
)
#: The TensorBoard writer records the run config once, as the text summary "config", which
#: TensorBoard stores under this tensor tag (writers/tensorboard.py writes it).
CONFIG_TENSOR_TAG = "config/text_summary"
_STAGE_LABEL = re.compile(r"pp_stage_(\d+)")

Points = dict[str, dict[int, tuple[float, float]]]  # tag -> step -> (wall_time, value)


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
    """One event file's memory points and recorded configs ((wall_time, text) each)."""

    path: Path
    points: Points
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
        return f"steps {self.first_step}..{self.last_step}, started {date_time(self.started)}: {self.path}"


def is_host(name: str) -> bool:
    """A host-memory metric (measured against the node's RAM), else a device one."""
    return "host" in name


@dataclass
class MemoryRun:
    """The ``memory/`` series of one run, keyed by the tag without its prefix."""

    run_dir: Path
    series: dict[str, Series]
    skipped: list[str] = field(default_factory=list)  # "file: reason" for unreadable event files
    peak_window: str | None = None  # memory_peak_window from the recorded config; None: not recorded
    files: list[EventFile] = field(default_factory=list)  # this run's event files, oldest first
    other_runs: list[list[EventFile]] = field(default_factory=list)  # other runs found, not reported
    reduce_scope: str | None = None  # memory_reduce_scope from the recorded config; None: not recorded

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
        names = {
            tag.partition("/")[2]
            for tag in self.series
            if tag.startswith("peak_stage/") or _STAGE_LABEL.fullmatch(tag.partition("/")[0])
        }
        return sorted(names, key=lambda name: (is_host(name), not name.startswith("peak_"), name))


# ---- reading ------------------------------------------------------------------------------


def load_run(run_dir: str | Path) -> MemoryRun:
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
    files = _event_files(run_dir)
    read, skipped = _read_each(files)
    if not read:
        raise ReportError(f"{run_dir}: {len(files)} event file(s) but no {PREFIX}* metrics in them; {EXPECTED}")
    *others, newest = split_runs(read)
    merged: Points = {}
    for part in newest:
        for tag, by_step in part.points.items():
            _keep_last_written(merged.setdefault(tag, {}), by_step.items())
    series = {}
    for tag, by_step in merged.items():
        steps = tuple(sorted(by_step))
        series[tag.removeprefix(PREFIX)] = Series(steps, tuple(by_step[s][1] for s in steps))
    configs = [config for part in newest for config in part.configs]
    scope = _config_field(configs, "memory_reduce_scope", "pp")
    return MemoryRun(run_dir, series, skipped, _peak_window(configs), newest, others, scope)


#: The folders of the TensorBoard writer's per-stage runs (``<tensorboard_dir>/pp_stage_{i}/``, or
#: ``pp_stage_{i}-2/`` .. where that name was taken by something else: each
#: stage's line under the max's tag, so TensorBoard overlays the stages). They repeat what the main
#: run holds as ``memory/pp_stage_{i}/<name>``; read as runs of their own they would be taken for
#: other jobs (their steps start over), so the report skips them.
STAGE_RUN = re.compile(r"pp_stage_\d+(-\d+)?")


def _event_files(run_dir: Path) -> list[Path]:
    """``run_dir`` itself if it is a file, else the event files below it, less the writer's
    per-stage runs (``STAGE_RUN``); ReportError if none."""
    if run_dir.is_file():
        return [run_dir]
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such directory; {EXPECTED}")
    files = sorted(
        path for path in run_dir.rglob(EVENT_GLOB) if path.is_file() and not STAGE_RUN.fullmatch(path.parent.name)
    )
    if not files:
        raise ReportError(f"{run_dir}: no TensorBoard event files found under it; {EXPECTED}")
    return files


def _read_each(files: list[Path]) -> tuple[list[EventFile], list[str]]:
    """The files holding memory points, and "file: reason" for each that could not be read."""
    read, skipped = [], []
    for path in files:
        try:
            points, configs = _read_event_file(path)
        except Exception as error:  # one corrupt file must not hide the others
            skipped.append(f"{path}: {type(error).__name__}: {error}")
            continue
        if points:  # a file without memory points (a run stopped before its first logging step) adds nothing
            read.append(EventFile(path, points, configs))
    return read, skipped


def _keep_last_written(into: dict[int, tuple[float, float]], points) -> None:
    """Add ``(step, (wall_time, value))`` points; on a step already held, the later wall time wins."""
    for step, (wall_time, value) in points:
        if step not in into or wall_time >= into[step][0]:
            into[step] = (wall_time, value)


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


def params_from_text(text: str) -> dict:
    """The run config as the TensorBoard writer recorded it (writers/tensorboard.config_text:
    indented JSON, secrets scrubbed) back into its dict. Raises ValueError for other text."""
    return json.loads("\n".join(line.removeprefix("    ") for line in text.splitlines()))


def _peak_window(configs: list[tuple[float, str]]) -> str | None:
    """memory_peak_window from one run's recorded configs, oldest first; "a -> b" when a
    resume changed it; None when no config was recorded. A config without the field was
    written before the option existed, when every peak was the run's."""
    return _config_field(configs, "memory_peak_window", "run")


def _config_field(configs: list[tuple[float, str]], name: str, default: str) -> str | None:
    """A logger field from one run's recorded configs, oldest first ("a -> b" when a resume
    changed it; ``default`` where a config lacks it); None when no config was recorded."""
    windows = []
    for _, text in sorted(configs):
        try:
            params = params_from_text(text)
        except ValueError:  # not a config this library wrote
            continue
        if not isinstance(params, dict):
            continue
        window = str(params.get(f"logger.{name}", params.get(name, default)))
        if not windows or windows[-1] != window:
            windows.append(window)
    return " -> ".join(windows) or None


def _read_event_file(path: Path) -> tuple[Points, list[tuple[float, str]]]:
    """One event file: step -> (wall_time, value) per memory tag, old- and new-style scalars
    (the last point written wins within the file); and (wall_time, text) of each run config
    recorded in it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    tensor_tags = accumulator.Tags().get("tensors", [])
    configs = []
    if CONFIG_TENSOR_TAG in tensor_tags:
        configs = [
            (e.wall_time, e.tensor_proto.string_val[0].decode("utf-8", "replace"))
            for e in accumulator.Tensors(CONFIG_TENSOR_TAG)
            if e.tensor_proto.string_val
        ]
    points: Points = {}
    for tag, triples in _memory_scalars(accumulator).items():
        _keep_last_written(points.setdefault(tag, {}), ((step, (wall, value)) for wall, step, value in triples))
    return points, configs


def _memory_scalars(accumulator) -> dict[str, list[tuple[float, int, float]]]:
    """(wall_time, step, value) per memory tag, as written: classic scalars, and single-value
    tensors where a tag has no classic scalar (``add_scalar(new_style=True)`` writes tensors)."""
    from tensorboard.util import tensor_util

    tags = accumulator.Tags()
    out = {}
    for tag in tags.get("scalars", []):
        if tag.startswith(PREFIX):
            out[tag] = [(e.wall_time, e.step, float(e.value)) for e in accumulator.Scalars(tag)]
    for tag in tags.get("tensors", []):
        if tag.startswith(PREFIX) and tag not in out:
            values = [(e.wall_time, e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)]
            out[tag] = [(w, s, float(v)) for w, s, v in values if v.size == 1]
    return out
