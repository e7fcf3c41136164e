"""The wire format of one rank's memory report: pure packing and unpacking, no collective.

One rank's report travels as ``HEADER + masks + values`` 64-bit words::

    [0] key count   [1] key-set fingerprint   [2] iteration (-1: unchecked)
    [3 .. 3+M)      bit mask: slot holds an int (not a float)
    [3+M .. 3+2M)   bit mask: slot is missing on this rank
    [3+2M ..)       one word per key: an int64, or a float64's bits

Ints therefore travel exactly (the full int64 range) and floats bit for bit, and the
receiving side needs no names: the fingerprint says whether every rank sent the same
keys in the same order. Packing is one ``struct.pack`` call, so the per-call Python
cost stays in microseconds.
"""

from __future__ import annotations

import math
import numbers
import struct
import warnings
import zlib
from dataclasses import dataclass
from functools import lru_cache

import torch

HEADER_WORDS = 3
MASK_BITS = 63  # keep every mask word a non-negative int64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
NOT_CHECKED = -1


@lru_cache(maxsize=64)
def layout_of(keys: tuple[str, ...]) -> "Layout":
    """The packing layout of a key tuple (cached: computed once per key set)."""
    mask_words = max(1, -(-len(keys) // MASK_BITS))
    fingerprint = zlib.crc32("\x1f".join(keys).encode()) | (len(keys) << 32)
    return Layout(keys, fingerprint, mask_words, HEADER_WORDS + 2 * mask_words + len(keys))


@dataclass(frozen=True)
class Layout:
    keys: tuple[str, ...]
    fingerprint: int
    mask_words: int
    words: int  # int64 words one rank sends


def pack(layout: Layout, report: dict, iteration: int | None, warn_key) -> bytes:
    """Encode ``report`` (keys in ``layout`` order) as the int64 words of the header above.

    A value that is not a clean number is sent as missing (or converted), and
    ``warn_key(key, why)`` is called so the caller can warn once: the rank still
    takes part in the collective.
    """
    n = len(layout.keys)
    kinds = []
    values = []
    int_mask = 0
    missing_mask = 0
    for slot, key in enumerate(layout.keys):
        value, kind, problem = scalar(report[key])
        if problem is not None:
            warn_key(key, problem)
        if kind == "q":
            int_mask |= 1 << slot
        elif kind is None:
            missing_mask |= 1 << slot
            value, kind = 0, "q"
        kinds.append(kind)
        values.append(value)
    masks = _split_mask(int_mask, layout.mask_words) + _split_mask(missing_mask, layout.mask_words)
    header = (n, layout.fingerprint, NOT_CHECKED if iteration is None else int(iteration))
    fmt = "<" + "q" * (HEADER_WORDS + 2 * layout.mask_words) + "".join(kinds)
    return struct.pack(fmt, *header, *masks, *values)


@dataclass(frozen=True)
class RankReport:
    """What one rank sent: its header, and its values (None where missing)."""

    key_count: int
    fingerprint: int
    iteration: int
    values: list


def unpack(layout: Layout, buffer: bytes, ranks: int) -> list[RankReport]:
    """Decode ``ranks`` consecutive reports of ``layout`` from ``buffer``."""
    stride = layout.words * 8
    masks_fmt = "<" + "q" * (HEADER_WORDS + 2 * layout.mask_words)
    reports = []
    for rank in range(ranks):
        offset = rank * stride
        head = struct.unpack_from(masks_fmt, buffer, offset)
        words = layout.mask_words
        int_mask = _join_mask(head[HEADER_WORDS : HEADER_WORDS + words])
        missing_mask = _join_mask(head[HEADER_WORDS + words :])
        fmt = "<" + "".join("q" if int_mask >> slot & 1 or missing_mask >> slot & 1 else "d" for slot in range(len(layout.keys)))
        values = list(struct.unpack_from(fmt, buffer, offset + struct.calcsize(masks_fmt)))
        if missing_mask:
            for slot in range(len(values)):
                if missing_mask >> slot & 1:
                    values[slot] = None
        reports.append(RankReport(head[0], head[1], head[2], values))
    return reports


def scalar(value):
    """Classify one report value as ``(python value, struct kind, problem)``.

    kind is "q" (int), "d" (float) or None (missing). problem is None, or a sentence
    for the one-time warning when the value was not a clean number. NaN is the
    documented 'this rank lacks it' marker and is missing without a problem.
    """
    kind_of = type(value)
    if kind_of is float:
        return (value, None, None) if value != value else (value, "d", None)
    if kind_of is int:
        if INT64_MIN <= value <= INT64_MAX:
            return value, "q", None
        return float(value), "d", f"int {value} is beyond int64, so it is carried as a float (rounded)"
    if isinstance(value, bool):
        return float(value), "d", "a bool is not a counter; it is logged as 0.0/1.0, pass an int or float"
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            return None, None, f"a tensor of shape {tuple(value.shape)} is not a scalar; pass a 0-d tensor or .item()"
        return scalar(value.item())
    if isinstance(value, numbers.Integral):
        return scalar(int(value))
    if isinstance(value, numbers.Real):
        return scalar(float(value))
    return None, None, f"{type(value).__name__} {value!r:.40} is not a number"


def _split_mask(mask: int, words: int) -> list[int]:
    low = (1 << MASK_BITS) - 1
    return [(mask >> (MASK_BITS * i)) & low for i in range(words)]


def _join_mask(words) -> int:
    mask = 0
    for i, word in enumerate(words):
        mask |= word << (MASK_BITS * i)
    return mask


def is_missing(value) -> bool:
    """True for the values a rank uses to say 'I lack this statistic'."""
    return value is None or (type(value) is float and math.isnan(value))
