"""The wire format of one rank's memory report: pure packing and unpacking, no collective.

One rank's report travels as ``HEADER + masks + values`` 64-bit words::

    [0] key count   [1] key-set fingerprint   [2] iteration (-1: unchecked)
    [3 .. 3+M)      bit mask: slot holds an int (not a float)
    [3+M .. 3+2M)   bit mask: slot is missing on this rank
    [3+2M ..)       one word per key: an int64, or a float64's bits

Ints therefore travel exactly (the full int64 range) and floats bit for bit, and the
receiving side needs no names: the fingerprint says whether every rank sent the same
keys in the same order. Packing and unpacking are one precompiled ``struct.Struct`` call
per rank (cached per layout and per int/float pattern), written straight into the
collective's buffer, so the per-call Python cost stays in microseconds.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    import numpy
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

HEADER_WORDS = 3
MASK_BITS = 63  # keep every mask word a non-negative int64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
NOT_CHECKED = -1


@lru_cache(maxsize=64)
def layout_of(keys: tuple[str, ...]) -> Layout:
    """The packing layout of a key tuple (cached: computed once per key set)."""
    mask_words = max(1, -(-len(keys) // MASK_BITS))
    # 63 bits of a cryptographic hash: two different key lists share a fingerprint with
    # odds of 2**-63, so a mismatch is never mistaken for agreement.
    digest = hashlib.blake2b("\x1f".join(keys).encode(), digest_size=8).digest()
    fingerprint = int.from_bytes(digest, "little") & INT64_MAX
    head = struct.Struct("<" + "q" * (HEADER_WORDS + 2 * mask_words))
    return Layout(keys, fingerprint, mask_words, HEADER_WORDS + 2 * mask_words + len(keys), head)


@dataclass(frozen=True)
class Layout:
    keys: tuple[str, ...]
    fingerprint: int
    mask_words: int
    words: int  # int64 words one rank sends
    head: struct.Struct  # header + masks


@lru_cache(maxsize=256)
def _values_struct(count: int, int_words: int) -> struct.Struct:
    """The Struct of ``count`` value words; bit i of ``int_words`` set: slot i is an int64."""
    return struct.Struct("<" + "".join("q" if int_words >> slot & 1 else "d" for slot in range(count)))


def pack(layout: Layout, report: dict, iteration: int | None, warn_key: Callable[[str, str], object]) -> bytes:
    """Encode ``report`` (keys in ``layout`` order) as the int64 words of the header above.

    A value that is not a clean number is sent as missing (or converted), and
    ``warn_key(key, why)`` is called so the caller can warn once: the rank still
    takes part in the collective.
    """
    buffer = bytearray(layout.words * 8)
    pack_into(buffer, layout, report, iteration, warn_key)
    return bytes(buffer)


def pack_into(
    buffer: Buffer | numpy.ndarray,
    layout: Layout,
    report: dict,
    iteration: int | None,
    warn_key: Callable[[str, str], object],
) -> None:
    """``pack``, written into the first ``layout.words`` int64 words of a writable ``buffer``."""
    values = []
    int_mask = 0
    missing_mask = 0
    bit = 1
    for key in layout.keys:
        value, kind, problem = scalar(report[key])
        if problem is not None:
            warn_key(key, problem)
        if kind == "q":
            int_mask |= bit
        elif kind is None:
            missing_mask |= bit
            value = 0
        values.append(value)
        bit <<= 1
    words = layout.mask_words
    header = (len(layout.keys), layout.fingerprint, NOT_CHECKED if iteration is None else int(iteration))
    if words == 1:
        layout.head.pack_into(buffer, 0, *header, int_mask, missing_mask)
    else:
        layout.head.pack_into(buffer, 0, *header, *_split_mask(int_mask, words), *_split_mask(missing_mask, words))
    _values_struct(len(values), int_mask | missing_mask).pack_into(buffer, layout.head.size, *values)


class RankReport(NamedTuple):
    """What one rank sent: its header, and its values (None where missing)."""

    key_count: int
    fingerprint: int
    iteration: int
    values: list


def unpack(layout: Layout, buffer: Buffer | numpy.ndarray, ranks: int) -> list[RankReport]:
    """Decode ``ranks`` consecutive reports of ``layout`` from ``buffer`` (any bytes-like object)."""
    count = len(layout.keys)
    fields = HEADER_WORDS + 2 * layout.mask_words
    heads = _heads_struct(fields, count, ranks).unpack_from(buffer)  # every rank's header + masks
    masks = [
        _masks(heads[start + HEADER_WORDS : start + fields], layout.mask_words)
        for start in range(0, ranks * fields, fields)
    ]
    if masks.count(masks[0]) == ranks:  # the usual case: one int/float/missing pattern on every rank
        int_mask, missing_mask = masks[0]
        flat = _all_values_struct(fields, count, ranks, int_mask | missing_mask).unpack_from(buffer)
        rows = [list(flat[start : start + count]) for start in range(0, ranks * count, count)]
    else:
        stride = layout.words * 8
        rows = [
            list(_values_struct(count, int_mask | missing_mask).unpack_from(buffer, rank * stride + fields * 8))
            for rank, (int_mask, missing_mask) in enumerate(masks)
        ]
    reports = []
    for rank, values in enumerate(rows):
        for slot in _set_bits(masks[rank][1]):
            values[slot] = None  # missing on this rank
        start = rank * fields
        reports.append(RankReport(heads[start], heads[start + 1], heads[start + 2], values))
    return reports


@lru_cache(maxsize=256)
def _set_bits(mask: int) -> tuple[int, ...]:
    return tuple(slot for slot in range(mask.bit_length()) if mask >> slot & 1)


def _masks(words: tuple, mask_words: int) -> tuple[int, int]:
    """(int mask, missing mask) from a rank's mask words."""
    if mask_words == 1:
        return words[0], words[1]
    return _join_mask(words[:mask_words]), _join_mask(words[mask_words:])


@lru_cache(maxsize=64)
def _heads_struct(fields: int, count: int, ranks: int) -> struct.Struct:
    """Reads every rank's header and masks, skipping the values."""
    return struct.Struct("<" + f"{fields}q{8 * count}x" * ranks)


@lru_cache(maxsize=64)
def _all_values_struct(fields: int, count: int, ranks: int, int_words: int) -> struct.Struct:
    """Reads every rank's values, skipping the headers, when every rank has one pattern."""
    values = _values_struct(count, int_words).format[1:]
    return struct.Struct("<" + f"{8 * fields}x{values}" * ranks)


def scalar(value: Any) -> tuple[int | float | None, str | None, str | None]:
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


def is_missing(value: object) -> bool:
    """True for the values a rank uses to say 'I lack this statistic'."""
    return value is None or (type(value) is float and math.isnan(value))
