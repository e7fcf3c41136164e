"""TensorBoard backend: one ``add_scalar`` per metric, the run config once as text, and every
pipeline stage's series also in a run of its own, so that one card overlays them all.

TensorBoard draws one line per run in a card, in the run's colour, and names the runs in its
legend: its idiom for several series of one quantity is one run per series under one tag. So
once a step holds two or more stages (``memory/pp_stage_{i}/<name>``), each stage's value is
also written as ``memory/<name>`` (the tag of the pipeline-wide max) in a run of its own,
``<tensorboard_dir>/pp_stage_{i}/`` (beside the run of an adopted writer: ``<its log_dir>/
pp_stage_{i}/``), one SummaryWriter per stage, opened when its stage first logs. TIME SERIES
then shows one card per metric: the max (the main run) and every stage, each its own colour.
The main run keeps everything it held before (its folder, its event file, the per-stage tags):
the per-stage tags are what ``nemo-memlog report`` and existing dashboards read, and a run of
one stage writes no stage run (its stage's line is the max).

A custom-scalars layout (category ``memory per stage``) charts exactly the per-stage metrics:
one chart per ``memory/<name>``, over every run, so the max and the stages of the metrics
logged per stage sit on one page without the other memory series (written at the first step
with stage runs, again when a later step brings a new name).

Enabled by ``tensorboard_dir``. Values are stored as TensorBoard's classic scalar
(``simple_value``), which is a float32: ints come back as floats, and ints above 2**24
lose precision. NaN, +inf and -inf are stored as they are and read back unchanged.
Tags are the metric names as given (TensorBoard accepts any string).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import process_wide
from ..redaction import scrubbed
from .base import writable_folder
from .stages import stage_values

if TYPE_CHECKING:
    from ..config import Settings

#: The text summary holding the run config; TensorBoard stores it as "<tag>/text_summary".
CONFIG_TAG = "config"
CONFIG_TENSOR_TAG = CONFIG_TAG + "/text_summary"
#: The custom-scalars category holding one chart per per-stage metric.
LAYOUT_CATEGORY = "memory per stage"


def enabled(settings: Settings) -> bool:
    return bool(settings.tensorboard_dir)


def open_backend(settings: Settings, params: dict, secrets: list[str]) -> TensorBoardBackend:
    """A SummaryWriter on ``tensorboard_dir``, with ``params`` recorded once as the "config" text."""
    from torch.utils.tensorboard import SummaryWriter

    writable_folder(settings.tensorboard_dir, "tensorboard_dir")
    writer = SummaryWriter(
        log_dir=settings.tensorboard_dir,
        max_queue=settings.tensorboard_queue_size,
    )
    writer.add_text(CONFIG_TAG, config_text(params, secrets), 0)
    _quiet_writer_thread(writer)
    return TensorBoardBackend(writer, log_dir=settings.tensorboard_dir, queue_size=settings.tensorboard_queue_size)


def _quiet_writer_thread(writer) -> None:
    """TensorBoard writes from a thread of its own, which prints a raw traceback when a write fails
    (a full disk) and hands the error to the next call: the fan-out says it once, in plain words."""
    event_writer = getattr(writer._get_file_writer(), "event_writer", None)
    thread = getattr(getattr(event_writer, "_async_writer", None), "_worker", None)
    if thread is not None:
        process_wide.quiet_thread(thread)


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


class TensorBoardBackend:
    """``writer``: the main run. ``log_dir``: its folder, under which each stage's run is opened
    (None: no stage runs). ``adopted``: someone else opened ``writer``: ``close`` leaves it open
    (the stage runs are ours: closed), and each step's stage points are flushed as they are
    written (an adopting framework may end without closing us)."""

    def __init__(self, writer: Any, *, log_dir: str | None = None, queue_size: int = 10, adopted: bool = False):
        self.writer = writer
        self.log_dir = log_dir
        self.queue_size = queue_size
        self.adopted = adopted
        self.stages: set[str] = set()  # the stage labels seen so far
        self.stage_writers: dict[str, Any] = {}  # label -> its run's SummaryWriter, opened at its first point
        self.charted: set[str] = set()  # the shared tags the layout has a chart for

    def log(self, metrics: dict, step: int) -> None:
        """One scalar per metric at ``step``, and each stage's value in its own run. Reads ``metrics`` only."""
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        found = list(stage_values(metrics))
        self.stages |= {label for label, _, _ in found}
        if not found or len(self.stages) < 2 or self.log_dir is None:
            return  # one stage: its line is the max's
        for label, tag, value in found:
            self._stage_writer(label).add_scalar(tag, value, step)
        tags = {tag for _, tag, _ in found}
        if not tags <= self.charted:
            self.charted |= tags
            self.writer.add_custom_scalars(layout(self.charted))
        if self.adopted:
            self._each_stage("flush")

    def _stage_writer(self, label: str) -> Any:
        writer = self.stage_writers.get(label)
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=os.path.join(self.log_dir, label), max_queue=self.queue_size)
            _quiet_writer_thread(writer)
            self.stage_writers[label] = writer
        return writer

    def _each_stage(self, what: str) -> None:
        """``what`` (flush, close) on every stage run; the first error raised after all were tried."""
        failed = None
        for writer in self.stage_writers.values():
            try:
                getattr(writer, what)()
            except Exception as error:  # the other stages still get theirs
                failed = failed or error
        if failed is not None:
            raise failed

    def flush(self) -> None:
        self.writer.flush()
        self._each_stage("flush")

    def close(self) -> None:
        """Close the stage runs, and the main run unless it was adopted (then it is flushed)."""
        try:
            self._each_stage("close")
        finally:
            if self.adopted:
                self.writer.flush()
            else:
                self.writer.close()
