"""TensorBoard backend: one ``add_scalar`` per metric, the run config once as text, and every
pipeline stage's series also in a run of its own, so that one card overlays them all.

TensorBoard draws one line per run in a card, in the run's colour, and names the runs in its
legend: its idiom for several series of one quantity is one run per series under one tag. So
once a step holds two or more stages (``memory/pp_stage_{i}/<name>``), each stage's value is
also written as ``memory/<name>`` (the tag of the pipeline-wide max) in a run of its own,
``<tensorboard_dir>/pp_stage_{i}/`` (beside the run of an adopted writer: ``<its log_dir>/
pp_stage_{i}/``), one run (EventWriter) per stage, opened when its stage first logs. TIME SERIES
then shows one card per metric: the max (the main run) and every stage, each its own colour.
The main run keeps everything it held before (its folder, its event file, the per-stage tags):
the per-stage tags are what ``nemo-memlog report`` and existing dashboards read, and a run of
one stage writes no stage run (its stage's line is the max).

A stage's run never costs the main run a step. Where ``pp_stage_{i}`` is taken by something that
is not a TensorBoard run (a file, a dangling link, a folder of other things) or cannot be opened,
the stage's run goes to the first free name of ``pp_stage_{i}-2`` .. ``-9``, or is skipped, said
once. A stage run that fails to write is said once per kind: a permanent OS error (base.
PERMANENT_ERRNOS) closes that stage's run for good, any other loses that point only; neither is
raised, so the main run is never retried (and written twice) for a stage's sake.

A custom-scalars layout (category LAYOUT_CATEGORY, which says what the run ``.`` is) charts
exactly the per-stage metrics: one chart per ``memory/<name>``, over every run, so the max and the stages of the metrics
logged per stage sit on one page without the other memory series (written at the first step
with stage runs, again when a later step brings a new name).

An adopted writer (a framework's own SummaryWriter: Megatron-LM's, Megatron-Bridge's) gets the run
config's text too, once, when it is adopted with one (``record_config``, from ``adopt_writers``).

Enabled by ``tensorboard_dir``. Values are stored as TensorBoard's classic scalar
(``simple_value``), which is a float32: ints come back as floats, and ints above 2**24
lose precision. NaN, +inf and -inf are stored as they are and read back unchanged.
Tags are the metric names as given (TensorBoard accepts any string).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import process_wide
from ..redaction import scrubbed
from ..warn import WarnOnce
from .base import PERMANENT_ERRNOS, os_errno, writable_folder
from .stages import stage_values

if TYPE_CHECKING:
    from ..config import Settings

#: The text summary holding the run config; TensorBoard stores it as "<tag>/text_summary".
CONFIG_TAG = "config"
CONFIG_TENSOR_TAG = CONFIG_TAG + "/text_summary"
#: The custom-scalars category holding one chart per per-stage metric.
LAYOUT_CATEGORY = "memory per stage (run '.' is the max over stages)"
#: The other names a stage's run may take when ``pp_stage_{i}`` is taken: ``pp_stage_{i}-2`` onwards.
OTHER_NAMES = 8
#: What an earlier run of ours leaves in a stage's folder (a folder holding only these is reused).
EVENT_FILE_PREFIX = "events.out.tfevents."


def enabled(settings: Settings) -> bool:
    return bool(settings.tensorboard_dir)


def open_backend(settings: Settings, params: dict, secrets: list[str]) -> TensorBoardBackend:
    """A run on ``tensorboard_dir`` (EventWriter: SummaryWriter's events, without torch),
    with ``params`` recorded once as the "config" text."""
    writable_folder(settings.tensorboard_dir, "tensorboard_dir")
    writer = EventWriter(settings.tensorboard_dir, max_queue=settings.tensorboard_queue_size)
    writer.add_text(CONFIG_TAG, config_text(params, secrets), 0)
    return TensorBoardBackend(
        writer, log_dir=settings.tensorboard_dir, queue_size=settings.tensorboard_queue_size, secrets=secrets
    )


def config_text(params: dict, secrets: list[str]) -> str:
    """``params`` as indented JSON (a markdown code block), with every secret scrubbed."""
    text = scrubbed(json.dumps(params, indent=2, sort_keys=True, default=str), secrets)
    # Four leading spaces make TensorBoard's markdown render it verbatim.
    return "\n".join("    " + line for line in text.splitlines())


def adopt(obj: object) -> TensorBoardBackend | None:
    """A SummaryWriter (torch's or tensorboardX's) that someone else opened, else None."""
    if type(obj).__module__.startswith(("torch.utils.tensorboard", "tensorboardX")) and hasattr(obj, "add_scalar"):
        return TensorBoardBackend(obj, log_dir=log_dir_of(obj), adopted=True)
    return None


def log_dir_of(writer: Any) -> str | None:
    """The folder of an open SummaryWriter (torch's ``log_dir``, tensorboardX's ``logdir``), else None."""
    get = getattr(writer, "get_logdir", None)
    folder = get() if callable(get) else getattr(writer, "log_dir", None)
    return os.fspath(folder) if folder else None


def params_from_text(text: str) -> dict:
    """The inverse of config_text (for the report command): the recorded params, secrets scrubbed."""
    return json.loads("\n".join(line.removeprefix("    ") for line in text.splitlines()))


def layout(tags: Iterable[str]) -> dict:
    """The custom-scalars layout: per shared tag (``memory/<name>``), one chart of that tag in
    every run: the max (main run) and each stage (its run)."""
    charts = {tag.removeprefix("memory/"): ["Multiline", [f"^{re.escape(tag)}$"]] for tag in sorted(tags)}
    return {LAYOUT_CATEGORY: charts}


def stage_folder_names(label: str) -> list[str]:
    """The folders a stage's run may take, in order: ``pp_stage_1``, ``pp_stage_1-2``, ..."""
    return [label] + [f"{label}-{n}" for n in range(2, 2 + OTHER_NAMES)]


def free_for_a_run(path: str) -> bool:
    """``path`` is absent, or a folder holding TensorBoard event files only (an earlier run's,
    appended to as TensorBoard does); not a file, a dangling link, or a folder of other things."""
    if not os.path.lexists(path):
        return True
    try:
        return os.path.isdir(path) and all(name.startswith(EVENT_FILE_PREFIX) for name in os.listdir(path))
    except OSError:
        return False


class TensorBoardBackend:
    """``writer``: the main run. ``log_dir``: its folder, under which each stage's run is opened
    (None: no stage runs). ``adopted``: someone else opened ``writer``: ``close`` leaves it open
    (the stage runs are ours: closed), and each step's stage points are flushed as they are
    written (an adopting framework may end without closing us). Only the main run's errors
    are raised; a stage run's are said once (``secrets`` scrubbed) and never raised."""

    def __init__(
        self,
        writer: Any,
        *,
        log_dir: str | None = None,
        queue_size: int = 10,
        adopted: bool = False,
        secrets: list[str] | tuple[str, ...] = (),
    ):
        self.writer = writer
        self.log_dir = log_dir
        self.queue_size = queue_size
        self.adopted = adopted
        self.stages: set[str] = set()  # the stage labels seen so far
        # label -> its run's EventWriter, opened at its first point; None: skipped for good
        self.stage_writers: dict[str, Any] = {}
        self.charted: set[str] = set()  # the shared tags the layout has a chart for
        self._warn_once = WarnOnce("tensorboard backend: ", secrets)

    def record_config(self, params: dict, secrets: list[str]) -> None:
        """Record ``params`` as the run's "config" text at step 0, secrets scrubbed, as ``open_backend``
        does for a run of ours: into an adopted writer (a framework's own SummaryWriter), so that
        ``nemo-memlog report`` reads the run's ``memory_peak_window`` from its event file."""
        self.writer.add_text(CONFIG_TAG, config_text(params, secrets), 0)

    def log(self, metrics: dict, step: int) -> None:
        """One scalar per metric at ``step``, and each stage's value in its own run. Reads ``metrics`` only."""
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        found = list(stage_values(metrics))
        self.stages |= {label for label, _, _ in found}
        if not found or len(self.stages) < 2 or self.log_dir is None:
            return  # one stage: its line is the max's
        for label, tag, value in found:
            writer = self._stage_writer(label)
            if writer is not None:
                self._stage_call(label, writer.add_scalar, tag, value, step)
        tags = {tag for _, tag, _ in found}
        if not tags <= self.charted:
            self.charted |= tags
            self.writer.add_custom_scalars(layout(self.charted))
        if self.adopted:
            self._each_stage("flush")

    def _stage_writer(self, label: str) -> Any:
        """The run of stage ``label``, opened at its first point; None when it is skipped."""
        if label not in self.stage_writers:
            self.stage_writers[label] = self._open_stage_run(label)
        return self.stage_writers[label]

    def _open_stage_run(self, label: str) -> Any:
        """A run (EventWriter) on the first of ``stage_folder_names(label)`` that is free and opens;
        None (said once) when none does. Never raises."""
        taken = []
        for name in stage_folder_names(label):
            folder = os.path.join(self.log_dir, name)
            if not free_for_a_run(folder):
                taken.append(f"{name} ({_what_is_at(folder)})")
                continue
            try:
                # Probed first: TensorBoard's own writer opens its file in a thread, failing later.
                writable_folder(folder, "tensorboard_dir")
                writer = EventWriter(folder, max_queue=self.queue_size)
            except Exception as error:  # a folder we may not write: the next name
                cause = error.__cause__ or error
                taken.append(f"{name} ({type(cause).__name__}: {cause})")
                continue
            if taken:
                self._warn_once(
                    ("stage folder", label),
                    f"{label}'s run is written to {folder}, as {', '.join(taken)} is taken; the main run is unaffected",
                )
            return writer
        self._warn_once(
            ("stage folder", label),
            f"{label} gets no run of its own in {self.log_dir} ({', '.join(taken[:3])}, ... taken); "
            f"its series stays in the main run as memory/{label}/<name>",
        )
        return None

    def _stage_call(self, label: str, fn, *args) -> None:
        """``fn(*args)`` on stage ``label``'s run. A failure is said once per kind and never raised:
        a permanent OS error closes that stage's run for good, another loses this call only."""
        try:
            fn(*args)
        except Exception as error:  # a stage's run never holds back the main run
            permanent = os_errno(error) in PERMANENT_ERRNOS
            if permanent:
                writer, self.stage_writers[label] = self.stage_writers.get(label), None
                if writer is not None:
                    try:
                        writer.close()
                    except Exception:  # already failing: closed as far as it can be
                        pass
            self._warn_once(
                (label, type(error).__name__),
                f"{label}'s run failed with {type(error).__name__}: {error}; "
                + ("it is closed for good" if permanent else "that point is not in it")
                + " (the main run goes on whole)",
            )

    def _each_stage(self, what: str) -> None:
        """``what`` (flush, close) on every stage run; failures said, never raised."""
        for label, writer in list(self.stage_writers.items()):
            if writer is not None:
                self._stage_call(label, getattr(writer, what))

    def flush(self) -> None:
        self.writer.flush()
        self._each_stage("flush")

    def close(self, deadline: float | None = None) -> None:
        """Close the stage runs, and the main run unless it was adopted (then it is flushed)."""
        try:
            self._each_stage("close")
        finally:
            if self.adopted:
                self.writer.flush()
            else:
                self.writer.close()


def _what_is_at(path: str) -> str:
    if os.path.islink(path) and not os.path.exists(path):
        return "a dangling link"
    return "a folder of other things" if os.path.isdir(path) else "a file"


# A run written with the tensorboard package alone: the events torch's SummaryWriter writes for the
# calls above (add_scalar, add_text, add_custom_scalars of multiline charts, flush, close), through the
# same EventFileWriter (the same file names, queue and flushing thread), without importing torch: the
# writer process starts about 1.4 CPU-seconds sooner and holds some 200 MB less on the writer rank's
# node. A SummaryWriter someone else opened (torch's, tensorboardX's) is written through its own methods.


class EventWriter:
    """One run's event file in ``log_dir``, opened at once (as SummaryWriter opens it). TensorBoard
    writes from a thread of its own, which prints a raw traceback when a write fails (a full disk) and
    hands the error to the next call: that thread is quieted, and the fan-out says it once, in plain words."""

    def __init__(self, log_dir: str, max_queue: int = 10, flush_secs: int = 120):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = str(log_dir)
        self.event_writer = EventFileWriter(self.log_dir, max_queue, flush_secs, "")
        thread = getattr(getattr(self.event_writer, "_async_writer", None), "_worker", None)
        if thread is not None:
            process_wide.quiet_thread(thread)

    def get_logdir(self) -> str:
        return self.log_dir

    def add_scalar(self, tag: str, value: float, step: int | None = None) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))]), step)

    def add_text(self, tag: str, text: str, step: int | None = None) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

        content = TextPluginData(version=0).SerializeToString()
        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text", content=content))
        tensor = _strings([text.encode("utf_8")], shape=[1])
        self._add(Summary(value=[Summary.Value(tag=f"{tag}/text_summary", metadata=metadata, tensor=tensor)]), step)

    def add_custom_scalars(self, layout: dict) -> None:
        """``{category: {title: ["Multiline", [tag regex, ...]]}}``, as SummaryWriter takes it."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.plugins.custom_scalar import layout_pb2

        categories = []
        for category, charts in layout.items():
            shown = []
            for title, (kind, tags) in charts.items():
                if kind != "Multiline":
                    raise ValueError(f"custom scalars chart {title!r}: only 'Multiline' is written, not {kind!r}")
                shown.append(layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=tags)))
            categories.append(layout_pb2.Category(title=category, chart=shown))
        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="custom_scalars"))
        tensor = _strings([layout_pb2.Layout(category=categories).SerializeToString()], shape=[])
        self._add(Summary(value=[Summary.Value(tag="custom_scalars__config__", tensor=tensor, metadata=metadata)]))

    def flush(self) -> None:
        self.event_writer.flush()

    def close(self) -> None:
        self.event_writer.flush()
        self.event_writer.close()

    def _add(self, summary, step: int | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        event = Event(summary=summary, wall_time=time.time())
        if step is not None:
            event.step = int(step)
        self.event_writer.add_event(event)


def _strings(values: list[bytes], shape: list[int]):
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

    dims = [TensorShapeProto.Dim(size=size) for size in shape]
    return TensorProto(dtype="DT_STRING", string_val=values, tensor_shape=TensorShapeProto(dim=dims))
