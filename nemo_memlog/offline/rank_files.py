"""Read the flight records: one ring file per rank, as recorder.py leaves it (format: records.py).

Reads ``*.memrec`` files anywhere below a folder, each with one ``read`` system call, and
checks every slot (length, checksum); prints nothing. Records are parsed only when asked:
a post-mortem of thousands of ranks needs the newest few of each. No torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..failure import records

#: recorder.py writes ``seq`` and ``kind`` first; where they are not, the slot is parsed instead.
_PEEK = re.compile(rb'\{"seq":(\d+),"kind":"(\w+)"')


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
                slot[3] = records.parse(slot[2])
            except records.RecordError as error:
                self.problems.append(f"record {slot[0]}: {error}")
            slot[2] = None  # parsed, or known bad: never again
        return slot[3]


def find_record_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Every ``*.memrec`` file at or below ``run_dir``, sorted."""
    found = []
    for folder, _, names in os.walk(run_dir):
        found += [Path(folder, name) for name in names if name.endswith(records.SUFFIX)]
    return sorted(found)


def read_rank_file(path: str | Path) -> RankFile:
    """Read one rank's file with a single read and check every slot (length, checksum). Raises
    RecordError when the header cannot be used (empty, truncated, garbage, another format or
    version); a torn or corrupted liveness or record slot, or a truncated ring, is listed in
    ``problems`` and the rest is kept."""
    path = Path(path)
    data = _read_once(path)
    if not data:
        raise records.RecordError("empty file (0 bytes)")
    try:
        header = records.check_header(records.decode(data[: records.HEADER_BYTES]))
    except records.RecordError as error:
        raise records.RecordError(f"header: {error}") from None
    slots, slot_bytes = int(header["slots"]), int(header["slot_bytes"])
    problems = []
    expected = records.file_bytes(slots, slot_bytes)
    if len(data) < expected:
        problems.append(f"file truncated: {len(data)} of {expected} bytes")
    try:
        liveness = records.decode(data[records.HEADER_BYTES : records.RECORDS_AT])
    except records.RecordError as error:
        liveness = None
        problems.append(f"liveness slot: {error}")
    found = _record_slots(data, slots, slot_bytes, problems)
    return RankFile(path, header, liveness, found, problems)


def _read_once(path: Path) -> bytes:
    """The whole file in one read system call (a buffered read() makes two, and more for a large file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


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
        record = records.parse(body)
    except records.RecordError as error:
        problems.append(f"record slot {slot}: {error}")
        return None
    seq = record.get("seq")
    return [seq if isinstance(seq, int) else -1, record.get("kind"), None, record]
