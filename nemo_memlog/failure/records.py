"""The flight-record file format: one file per rank, written by recorder.py, read by postmortem.py.

Pure encoding and decoding: no torch, no collective, no I/O policy. Like payload.py for the
collective, this is the one place both sides agree on, and its header carries a version.

One rank's file, ``rank-<global rank, 5 digits>.memrec``, is a fixed-size ring in the page cache::

    [0, HEADER_BYTES)                          header slot: who wrote the file (JSON, below)
    [HEADER_BYTES, +LIVENESS_BYTES)            liveness slot: rewritten about once a second
    [RECORDS_AT, +slots * slot_bytes)          record slots: record ``seq`` lives in slot ``seq % slots``

Every slot is ``<8 hex: payload length> <8 hex: crc32 of payload>\\n<payload>`` padded with NUL
bytes to the slot's size; the payload is UTF-8 JSON of one object. A slot that was never
written is all NUL; one whose length or checksum does not match was torn or corrupted, and the
reader says so instead of guessing. Each slot is written with one ``pwrite``, so a process
killed at any instant (SIGKILL, the OOM killer) leaves every earlier slot intact: the kernel
keeps the pages after the process dies, no fsync needed (a lost node loses them, as it loses
everything else).

The header object::

    {"format": "nemo_memlog.memrec", "version": 1, "run_id": str, "rank": int, "world_size": int,
     "pp_rank": int, "tp_rank": int, "dp_rank": int, "host": str, "pid": int,
     "started": float (unix time), "slots": int, "slot_bytes": int, "liveness_period_s": float}

The liveness object (``alive`` is unix time; the rest is host evidence, null where the machine
does not show it)::

    {"alive": float, "beats": int, "iteration": int|null (the last step recorded),
     "host_available_gb": float, "host_rss_gb": float,
     "vmstat_oom_kill": int|null, "cgroup_oom_kill": int|null,
     "host_limit_gb": float|null, "host_limit_used_gb": float|null,
     "phase": str (only inside a memory phase), "phase_started": float, "phase_iteration": int|null}

(the memory cgroup's limit and usage: rank/host_limit.py; the phase: measure/phase.py. Added within
version 1: a reader that does not know a field ignores it.)

A record object: ``{"seq": int, "kind": KIND, "time": float, "iteration": int|null, "report": {...}}``
plus, per kind:

- ``"step"``: a logging step; ``report`` is report_memory() + capacity_report().
- ``"oom"``: a CUDA out-of-memory error, from the allocator's observer on the failing rank:
  ``"device": int, "bytes_requested": int, "device_limit": int, "device_free": int``, and where
  the allocator snapshot was taken, ``"snapshot": file name beside the record`` and
  ``"largest_free_block": int`` (bytes), ``"reserved_free": int`` (bytes free inside segments).
- ``"end"``: the process ended in a way it could record: ``"reason"``: one of END_REASONS,
  ``"detail": str``, and the OOM-kill counters then, ``"vmstat_oom_kill"``, ``"cgroup_oom_kill"``
  (int|null; added within version 1).
- ``"phase"``: a memory phase (measure/phase.py) began or ended: ``"name": str``, ``"event"``: "start"
  or "end", ``"started": float`` (the phase's start); ``report`` is {}. Added within version 1:
  older readers skip a kind they do not know.
"""

from __future__ import annotations

import json
import re
import zlib

FORMAT = "nemo_memlog.memrec"
VERSION = 1
SUFFIX = ".memrec"
HEADER_BYTES = 4096
LIVENESS_BYTES = 512
RECORDS_AT = HEADER_BYTES + LIVENESS_BYTES
#: Default ring: 16 records of 2 KB, about 37 KB per rank with header and liveness.
DEFAULT_SLOTS = 16
DEFAULT_SLOT_BYTES = 2048
KINDS = ("step", "oom", "end", "phase")
#: "close": a normal close; "sigterm": our SIGTERM handler ran; "exit": interpreter exit without
#: a close (sys.exit, end of script); "exception": exit through an unhandled exception.
END_REASONS = ("close", "sigterm", "exit", "exception")
#: An "exception" end whose detail says a peer of the rank's collective is gone (gloo's, NCCL's and
#: the sockets' words, and reduce/channel.py's own "a peer left"): a consequence of another rank's death,
#: which the post-mortem never names as the first failure.
PEER_LOSS = re.compile(
    r"connection (closed|reset) by peer|broken pipe|socket (was )?closed|ECONNRESET|EPIPE"
    r"|peer (closed|disconnected|exited|died|lost|left)|remote (process|peer|rank) (exited|closed|died)"
    r"|NCCL communicator was aborted|ncclRemoteError",
    re.IGNORECASE,
)
_PREFIX = 18  # "llllllll cccccccc\n"


class RecordError(ValueError):
    """A slot or file that cannot be decoded; the message says what is wrong with it."""


def file_name(rank: int) -> str:
    return f"rank-{rank:05d}{SUFFIX}"


def record_offset(seq: int, slots: int, slot_bytes: int) -> int:
    """Byte offset of the slot that holds record ``seq``."""
    return RECORDS_AT + (seq % slots) * slot_bytes


def file_bytes(slots: int, slot_bytes: int) -> int:
    return RECORDS_AT + slots * slot_bytes


def encode(obj: dict, size: int) -> bytes:
    """One slot of exactly ``size`` bytes holding ``obj``. Raises RecordError when it does not fit."""
    body = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    if len(body) + _PREFIX > size:
        raise RecordError(f"record of {len(body)} bytes does not fit a {size}-byte slot")
    head = b"%08x %08x\n" % (len(body), zlib.crc32(body))
    return head + body + b"\0" * (size - _PREFIX - len(body))


def decode(slot: bytes) -> dict | None:
    """The object in a slot; None for a slot never written (all NUL). Raises RecordError for a
    torn or corrupted slot."""
    body = payload(slot)
    return None if body is None else parse(body)


def payload(slot: bytes) -> bytes | None:
    """The checked JSON bytes of a slot, not parsed (a reader of many files parses only the
    records it needs); None for a slot never written. Raises RecordError as ``decode`` does."""
    if slot[:1] in (b"", b"\0") and not slot.strip(b"\0"):  # a written slot starts with its prefix
        return None
    try:
        length, crc = int(slot[0:8], 16), int(slot[9:17], 16)
    except ValueError:
        raise RecordError("slot prefix is not '<length> <crc32>'") from None
    body = slot[_PREFIX : _PREFIX + length]
    if slot[8:9] != b" " or slot[17:18] != b"\n" or len(body) != length:
        raise RecordError("slot is truncated or its prefix is malformed")
    if zlib.crc32(body) != crc:
        raise RecordError("slot checksum mismatch (torn or corrupted write)")
    return body


def parse(body: bytes) -> dict:
    """The object in a slot's checked bytes (``payload``). Raises RecordError if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError as error:
        raise RecordError(f"slot holds invalid JSON ({error})") from None
    except RecursionError:  # a nesting depth bomb
        raise RecordError("slot holds JSON nested too deep") from None
    if not isinstance(obj, dict):
        raise RecordError("slot does not hold a JSON object")
    return obj


def check_header(header: dict | None) -> dict:
    """``header`` if it is a header this reader understands; RecordError saying why not."""
    if header is None:
        raise RecordError("empty header: the file was created but never written")
    if header.get("format") != FORMAT:
        raise RecordError(f"not a nemo_memlog record file (format {header.get('format')!r})")
    if header.get("version") != VERSION:
        raise RecordError(
            f"record format version {header.get('version')!r}; this nemo-memlog reads version "
            f"{VERSION}: use the nemo_memlog release that wrote the run"
        )
    for key in ("run_id", "rank", "slots", "slot_bytes"):
        if key not in header:
            raise RecordError(f"header lacks {key!r}")
    return header
