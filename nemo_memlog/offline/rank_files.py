"""Read the flight records: one ring file per rank, as recorder.py leaves it (format: records.py).

Reads ``*.memrec`` files anywhere below a folder, each with one ``read`` system call, and
checks every slot (length, checksum); prints nothing. Records are parsed only when asked:
a post-mortem of thousands of ranks needs the newest few of each. No torch.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..bounded import read_regular
from ..failure import records
from .tables import finite_number, printable

#: recorder.py writes ``seq`` and ``kind`` first; where they are not, the slot is parsed instead.
_PEEK = re.compile(rb'\{"seq":(\d{1,18}),"kind":"(\w{1,32})"')
#: Bounds on what a header may say; a file outside them is unreadable, the field named. The default
#: ring is 16 slots of 2 KB (37 KB a rank); a file is read whole, so it is capped.
MAX_FILE_BYTES = 64 << 20
MAX_SLOTS = 1 << 16
MIN_SLOT_BYTES = 64
MAX_SLOT_BYTES = 1 << 20
MAX_RANKS = 1 << 22
MAX_LIVENESS_PERIOD_S = 86400.0


@dataclass(eq=False)  # identity: one object per file
class RankFile:
    """One rank's file: header, liveness (None when never written or unreadable), its checked
    record slots oldest first, parsed only when asked, and what could not be read, in words."""

    path: Path
    header: dict
    liveness: dict | None
    slots: list[list]  # [seq, kind or None, checked JSON bytes, parsed record or None], oldest first
    problems: list[str] = field(default_factory=list)

    def newest(self, kind: str | None = None, want: Callable[[dict], bool] | None = None) -> dict | None:
        """The newest record of ``kind`` (any kind: None) for which ``want(record)`` holds."""
        for slot in reversed(self.slots):
            if kind is not None and slot[1] is not None and slot[1] != kind:
                continue
            record = self._parsed(slot)
            if record is not None and kind in (None, record.get("kind")) and (want is None or want(record)):
                return record
        return None

    @property
    def records(self) -> list[dict]:
        """Every readable record, oldest first (parses them all)."""
        return [record for record in map(self._parsed, self.slots) if record is not None]

    def _parsed(self, slot: list) -> dict | None:
        if slot[3] is None and slot[2] is not None:
            try:
                slot[3] = checked_sizes(records.parse(slot[2]))
            except records.RecordError as error:
                self.problems.append(f"record {slot[0]}: {error}")
            slot[2] = None  # parsed, or known bad: never again
        return slot[3]


def checked_sizes(record: dict) -> dict:
    """``record`` when every size in its ``report`` (a ``*_gb`` figure) is one: a finite number of GB
    from 0, or NaN (a statistic this rank lacks, as report_memory writes it); else RecordError naming
    the field. An infinite or negative size would be shown as what the rank held."""
    report = record.get("report")
    if not isinstance(report, dict):
        return record
    for key, value in report.items():
        if not (isinstance(key, str) and key.endswith("_gb")) or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and value == value and not (math.isfinite(value) and value >= 0):
            raise records.RecordError(f"field 'report.{printable(key)}': {value!r} is not a size (GB from 0, or NaN)")
    return record


def find_record_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Every ``*.memrec`` file at or below ``run_dir``, sorted."""
    found = []
    for folder, _, names in os.walk(run_dir):
        found += [Path(folder, name) for name in names if name.endswith(records.SUFFIX)]
    return sorted(found)


def read_rank_file(path: str | Path) -> RankFile:
    """Read one rank's file with a single read and check every slot (length, checksum). Raises
    RecordError when the file cannot be used: not a regular file (a FIFO, a device), larger than
    MAX_FILE_BYTES, empty, truncated (a partial copy: its newest records may be the lost part, so
    nothing in it is trusted), or a header that is garbage, another format or version, or has a
    field of the wrong type or out of range (the field named). A torn or corrupted liveness or
    record slot is listed in ``problems`` and the rest is kept."""
    path = Path(path)
    data = read_regular(path, MAX_FILE_BYTES)
    if not data:
        raise records.RecordError("empty file (0 bytes)")
    try:
        header = records.check_header(records.decode(data[: records.HEADER_BYTES]))
    except records.RecordError as error:
        raise records.RecordError(f"header: {error}") from None
    check_header_fields(header)
    slots, slot_bytes = header["slots"], header["slot_bytes"]
    expected = records.file_bytes(slots, slot_bytes)
    if len(data) < expected:
        raise records.RecordError(
            f"file truncated: {len(data)} of {expected} bytes (a partial copy? its newest records may be "
            "the part lost, so none of it is used)"
        )
    problems = []
    try:
        liveness = records.decode(data[records.HEADER_BYTES : records.RECORDS_AT])
    except records.RecordError as error:
        liveness = None
        problems.append(f"liveness slot: {error}")
    found = _record_slots(data, slots, slot_bytes, problems)
    return RankFile(path, header, liveness, found, problems)


def _whole(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def check_header_fields(header: dict) -> None:
    """Range-check the header's fields before anything uses them; RecordError naming the field."""

    def bad(key: str, expected: str) -> records.RecordError:
        shown = repr(header[key])
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        return records.RecordError(f"header field {key!r}: {shown} is not {expected}")

    required = {"rank": (0, MAX_RANKS - 1), "slots": (1, MAX_SLOTS), "slot_bytes": (MIN_SLOT_BYTES, MAX_SLOT_BYTES)}
    for key, (low, high) in required.items():
        if not _whole(header[key], low, high):
            raise bad(key, f"a whole number from {low} to {high}")
    if not isinstance(header["run_id"], str) or not 0 < len(header["run_id"]) <= 256:
        raise bad("run_id", "a text of 1 to 256 characters")
    if header.get("world_size") is not None:
        if not _whole(header["world_size"], 1, MAX_RANKS):
            raise bad("world_size", f"a whole number from 1 to {MAX_RANKS}")
        if header["rank"] >= header["world_size"]:
            raise bad("rank", f"below the header's world_size ({header['world_size']})")
    for key in ("pp_rank", "tp_rank", "dp_rank", "pid"):
        if header.get(key) is not None and not _whole(header[key], 0, 1 << 31):
            raise bad(key, "a whole number >= 0")
    if header.get("host") is not None and not isinstance(header["host"], str):
        raise bad("host", "a text")
    if header.get("started") is not None and finite_number(header["started"]) is None:
        raise bad("started", "a finite number (unix time)")
    period = header.get("liveness_period_s")
    if period is not None and not (finite_number(period) is not None and 0 < period <= MAX_LIVENESS_PERIOD_S):
        raise bad("liveness_period_s", f"a number of seconds above 0, at most {MAX_LIVENESS_PERIOD_S:g}")


def _record_slots(data: bytes, slots: int, slot_bytes: int, problems: list[str]) -> list[list]:
    """The checked, non-empty record slots of the ring, oldest (lowest seq) first; bad ones go to ``problems``."""
    found = []
    for slot in range(slots):
        start = records.record_offset(slot, slots, slot_bytes)
        if start >= len(data):
            break
        try:
            body = records.payload(data[start : start + slot_bytes])
        except records.RecordError as error:
            problems.append(f"record slot {slot}: {error}")
            continue
        if body is not None:
            found.append(_peeked(body, slot, problems))
    found = [entry for entry in found if entry is not None]
    found.sort(key=lambda entry: entry[0])
    return found


def _peeked(body: bytes, slot: int, problems: list[str]) -> list | None:
    """``[seq, kind, body, None]`` from the slot's first bytes, or parsed when they do not say."""
    match = _PEEK.match(body)
    if match:
        return [int(match.group(1)), match.group(2).decode(), body, None]
    try:
        record = checked_sizes(records.parse(body))
    except records.RecordError as error:
        problems.append(f"record slot {slot}: {error}")
        return None
    seq = record.get("seq")
    return [seq if isinstance(seq, int) else -1, record.get("kind"), None, record]
