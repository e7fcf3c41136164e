"""TensorBoard backend: one ``add_scalar`` per metric, the run config once as text, and a
custom-scalars layout: one chart per ``memory/pp_stage_{i}/<name>`` metric, every stage's line
overlaid (written at the first step, again when a later step brings a new per-stage name).

Enabled by ``tensorboard_dir``. Values are stored as TensorBoard's classic scalar
(``simple_value``), which is a float32: ints come back as floats, and ints above 2**24
lose precision. NaN, +inf and -inf are stored as they are and read back unchanged.
Tags are the metric names as given (TensorBoard accepts any string).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import process_wide
from ..config import scrubbed
from .base import writable_folder

if TYPE_CHECKING:
    from ..config import Settings

#: The text summary holding the run config; TensorBoard stores it as "<tag>/text_summary".
CONFIG_TAG = "config"
CONFIG_TENSOR_TAG = CONFIG_TAG + "/text_summary"
#: The custom-scalars category holding one chart per per-stage metric.
LAYOUT_CATEGORY = "memory per stage"
_PER_STAGE = re.compile(r"memory/pp_stage_\d+/(.+)")


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
    return TensorBoardBackend(writer)


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
        return TensorBoardBackend(obj)
    return None


def params_from_text(text: str) -> dict:
    """The inverse of config_text (for the report command): the recorded params, secrets scrubbed."""
    return json.loads("\n".join(line.removeprefix("    ") for line in text.splitlines()))


def layout(names: Iterable[str]) -> dict:
    """The custom-scalars layout: per name, one chart overlaying every stage's line."""
    charts = {name: ["Multiline", [rf"memory/pp_stage_\d+/{re.escape(name)}$"]] for name in sorted(names)}
    return {LAYOUT_CATEGORY: charts}


class TensorBoardBackend:
    def __init__(self, writer: Any):
        self.writer = writer
        self.charted: set[str] = set()  # the per-stage names the layout has a chart for

    def log(self, metrics: dict, step: int) -> None:
        """One scalar per metric at ``step``. Reads ``metrics`` only."""
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        names = {match.group(1) for match in map(_PER_STAGE.fullmatch, metrics) if match}
        if not names <= self.charted:
            self.charted |= names
            self.writer.add_custom_scalars(layout(self.charted))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
