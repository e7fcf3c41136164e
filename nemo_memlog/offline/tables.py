"""Plain-text tables and the number and time formats of the offline commands.

Reads no file and prints nothing: ``Column`` lists in, lines of text out; numbers and unix
times in, short strings out. The report's table (report.py), the post-mortem's text
(postmortem/render.py) and both PNGs (report/plot.py, postmortem/plot.py) format through here,
so one figure reads the same in every output.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from itertools import groupby

from ..units import size_text as size_text  # the units rule (a leaf: the advice formats through it too)

# ---- text from records and commands ---------------------------------------------------------

#: What a terminal takes for an instruction, not a character: the C0 and C1 controls (ESC starts a
#: terminal escape, CR overwrites the line), DEL, and the line and direction marks of Unicode.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_CONTROL_IN_LINES = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(match.group(), match.group().encode("unicode_escape").decode())


def printable(text: str, lines: bool = False) -> str:
    """``text`` from a record or a command's output as the offline commands show it: every control
    character and terminal escape written out (``"\\n"``, ``"\\x1b"``), so a record's string cannot
    forge a line, colour or clear the screen. ``lines``: newlines kept (a command's output tail)."""
    return (_CONTROL_IN_LINES if lines else _CONTROL).sub(_escape, text)


# ---- tables -------------------------------------------------------------------------------


@dataclass
class Column:
    """One table column: its cells as text, under a header and a spanning group header."""

    group: str  # spanning header over consecutive columns with the same group
    header: str
    cells: list[str]
    left: bool = False

    @property
    def width(self) -> int:
        return max(len(self.header), *(len(c) for c in self.cells)) if self.cells else len(self.header)


def render_table(columns: list[Column], width: int) -> list[str]:
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
        lines += ([""] if lines else []) + render_block([first, *block])
    return lines


def _block_width(columns: list[Column]) -> int:
    groups = len([1 for _ in groupby(columns, key=lambda column: column.group)])
    return sum(column.width for column in columns) + 2 * (len(columns) - 1) + (groups - 1)


def _printable_column(column: Column) -> Column:
    """``column`` with its texts as shown (``printable``): a cell from a record is one line."""
    cells = [printable(cell) for cell in column.cells]
    return Column(printable(column.group), printable(column.header), cells, column.left)


def render_block(columns: list[Column]) -> list[str]:
    """Group line, header line, rule, rows. Two spaces between columns, three between groups."""

    columns = [_printable_column(column) for column in columns]
    widths = [column.width for column in columns]  # once: a property over every cell (linear in rows)
    gaps = [""] + ["   " if a.group != b.group else "  " for a, b in zip(columns, columns[1:])]
    pads = [(str.ljust if column.left else str.rjust) for column in columns]

    def row(texts):
        return "".join(gap + pad(text, width) for gap, pad, width, text in zip(gaps, pads, widths, texts)).rstrip()

    spans = [list(span) for _, span in groupby(range(len(columns)), key=lambda i: columns[i].group)]
    groups = "   ".join(
        columns[span[0]].group.center(sum(widths[i] for i in span) + 2 * (len(span) - 1)) for span in spans
    )
    header = row([column.header for column in columns])
    return [groups.rstrip(), header, "-" * len(header), *(row(cells) for cells in zip(*(c.cells for c in columns)))]


# ---- numbers ------------------------------------------------------------------------------


def finite_number(value: object) -> float | None:
    """A finite number as it is, else None (JSON null, NaN for a statistic a rank lacks, a bool, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def whole_number(value: object) -> int | None:
    """A finite number cut to an int (byte counts), else None."""
    number = finite_number(value)
    return None if number is None else int(number)


def unit(name: str) -> str | None:
    """The unit a metric's name ends with: "GB" for ``*_gb``, "%" for ``*_pct``, else None."""
    if name.endswith("_gb"):
        return "GB"
    if name.endswith("_pct"):
        return "%"
    return None


def size_scale(largest_gb: float) -> tuple[str, float]:
    """A picture's axis by the units rule: ("MB", 1000) when its largest size is under 1 GB, else ("GB", 1)."""
    return ("MB", 1000.0) if largest_gb < 1 else ("GB", 1.0)


def metric_cell(name: str, value: float | None) -> str:
    """A logged metric's value as the report prints it: sizes (``*_gb``) by the units rule
    (``size_text``, with the unit), percentages one decimal, counters and stage indices whole."""
    if value is None:
        return "-"
    if unit(name) == "%":
        return f"{value:.1f}"
    if unit(name) == "GB":
        return size_text(value)
    if float(value).is_integer():  # counters (alloc_retries) and stage indices
        return str(int(value))
    return f"{value:.3g}"


def gb_cell(value: float | None) -> str:
    """A size in GB in a table cell, by the units rule (``size_text``): "1.84 GB", "543 MB", "-"."""
    return size_text(value)


def gb_text(value: float | None, scale: float = 1e9) -> str:
    """Bytes (or GB with ``scale=1``) as a size for a sentence, by the units rule, short: "61 GB",
    "1.3 GB", "400 MB"; "? GB" for none."""
    if value is None:
        return "? GB"
    return size_text(value / scale, short=True)


def cell(value: object) -> str:
    """Any value in a table cell: ``str``, "-" for none."""
    return "-" if value is None else str(value)


# ---- times (this machine's local time) ----------------------------------------------------


def clock(stamp: float | None, fraction: bool = False) -> str:
    """HH:MM:SS (with tenths: ``fraction``), "-" for none."""
    if stamp is None:
        return "-"
    text = time.strftime("%H:%M:%S", time.localtime(stamp))
    return f"{text}.{int(stamp % 1 * 10)}" if fraction else text


def date_time(stamp: float | None) -> str:
    """YYYY-MM-DD HH:MM:SS, "unknown" for none or a non-finite time."""
    if stamp is None or not math.isfinite(stamp):
        return "unknown"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def iso_time(stamp: float | None) -> str | None:
    """ISO 8601 with the UTC offset, None for none."""
    return None if stamp is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(stamp))
