"""Turn gathered per-stage reports into the logged memory metrics. Pure: no collective.

``line_up(keys, reports)`` lines the reports the collective delivered up by key: the per-key
maximum and the rank holding it (a ``GatheredMemory``). From one GatheredMemory (position i =
pipeline stage i) it derives:

    memory/<name>                     max over stages (what the dashboards plotted before, fixed)
    memory/peak_stage/<name>          int: the stage holding that max (lowest stage on ties)
    memory/pp_stage_{i}/<name>        stage i's own value, for names matching memory_per_stage_keys
    memory/headroom_gb                min over stages of device_total - device_other - peak_reserved (CUDA)
    memory/headroom_stage             int: that stage
    memory/peak_reserved_pct          100 * peak_reserved / device_total at that stage
    memory/host_headroom_gb           min over stages of the distance to the OOM killer (SIGKILL): the
                                      host's MemAvailable, or, inside a memory cgroup with a limit,
                                      the smaller of it and the limit minus the cgroup's usage
    memory/host_headroom_stage        int: that stage
    memory/host_limit_gb              the cgroup memory limit binding a stage (max over stages); absent
                                      when no stage has one (each rank reports NaN), as before the limit
    memory/peak_host_rss_pct          max over stages of 100 * peak_host_rss / (the limit, else host_total)

The ``peak_*`` inputs cover the window rank/memory.py measured them over (memory_peak_window:
the run, or the interval since the previous logging step); everything above follows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import NamedTuple

from .keys import (
    DEVICE_OTHER,
    DEVICE_TOTAL,
    HEADROOM,
    HEADROOM_STAGE,
    HOST_AVAILABLE,
    HOST_HEADROOM,
    HOST_HEADROOM_STAGE,
    HOST_LIMIT,
    HOST_LIMIT_USED,
    HOST_TOTAL,
    PEAK_HOST_RSS,
    PEAK_HOST_RSS_PCT,
    PEAK_RESERVED,
    PEAK_RESERVED_PCT,
)


@dataclass
class GatheredMemory:
    """Every rank's report, lined up by key; what ``gather_memory`` returns.

    Ranks are positions in the group (the pipeline stage, for a PP group).

    Attributes:
        keys: the agreed keys, in order.
        per_rank: ``per_rank[r][i]`` is rank r's value of ``keys[i]``; None where missing.
            ints stay ints, floats stay floats.
        maximum: key -> the max over ranks (a float where any rank sent a float); keys
            every rank lacks are absent.
        peak_rank: key -> the rank holding that max (the lowest on ties).
    """

    keys: tuple[str, ...]
    per_rank: list[list]  # per_rank[r][i]: rank r's value of keys[i], None where missing
    maximum: dict = field(default_factory=dict)  # key -> max over ranks (keys every rank lacks: absent)
    peak_rank: dict = field(default_factory=dict)  # key -> the rank holding the maximum (lowest on ties)


def line_up(keys: tuple[str, ...], reports: list) -> GatheredMemory:
    """Every rank's values (``payload.RankReport``), lined up by ``keys``: the per-key maximum
    and the lowest rank holding it. Pure: no collective, no mutation."""
    per_rank = [report.values for report in reports]
    maximum = {}
    peak_rank = {}
    for key, column in zip(keys, zip(*per_rank)):
        try:
            best = max(column)  # the first of equal maxima: the lowest rank holds a tie
        except TypeError:  # None (missing on some rank) does not compare
            best = None
        if best is None:
            present = [value for value in column if value is not None]
            if not present:
                continue
            best = max(present)
            rank = next(r for r, value in enumerate(column) if value is not None and value == best)
        else:
            rank = column.index(best)
        if type(best) is int and float in map(type, column):
            best = float(best)  # one rank sent a float: the key is a float key
        maximum[key] = best
        peak_rank[key] = rank
    return GatheredMemory(keys, per_rank, maximum, peak_rank)


PREFIX = "memory/"
#: Capacity keys (memory.capacity_report) feed headroom; their max has no "peak stage".
CAPACITY = frozenset({DEVICE_TOTAL.key, HOST_TOTAL.key, HOST_AVAILABLE.key, HOST_LIMIT.key})


def memory_metrics(
    gathered: GatheredMemory,
    per_stage_patterns: Iterable[str] = ("peak_*",),
    stage_names: Sequence[str] | None = None,
) -> dict:
    """The logged dict for one step. ``stage_names[i]`` labels position i (default: ``pp_stage_{i}``)."""
    keys = gathered.keys
    per_rank = gathered.per_rank
    labels = stage_names or [f"pp_stage_{i}" for i in range(len(per_rank))]
    out = {}
    for key, value in gathered.maximum.items():
        if key != HOST_AVAILABLE.key:  # its max says nothing: memory/host_headroom_gb is its min
            out[PREFIX + key] = value
    for key, rank in gathered.peak_rank.items():
        if key not in CAPACITY:
            out[f"{PREFIX}peak_stage/{key}"] = rank
    for slot in _per_stage_slots(keys, tuple(per_stage_patterns)):
        key = keys[slot]
        for rank, values in enumerate(per_rank):
            if values[slot] is not None:
                out[f"{PREFIX}{labels[rank]}/{key}"] = values[slot]
    out.update(_headroom(keys, per_rank))
    return out


def stage_value(
    gathered: GatheredMemory, stage: int, key: str, *, stage_of: Sequence[int] | None = None
) -> float | None:
    """Pipeline stage ``stage``'s own value of ``key``, as the per-stage metrics give it: the value
    at position ``stage`` (a PP group), or, given ``stage_of`` (the world scope: positions are
    global ranks, ``stage_of[r]`` the stage of position r), the max over that stage's ranks. None
    where no rank has it."""
    if key not in gathered.keys:
        return None
    slot = gathered.keys.index(key)
    if stage_of is not None:
        present = [v[slot] for v, s in zip(gathered.per_rank, stage_of) if s == stage and v[slot] is not None]
        return max(present) if present else None
    return gathered.per_rank[stage][slot] if stage < len(gathered.per_rank) else None


def stage_figures(
    gathered: GatheredMemory, stage: int, keys: Iterable[str], *, stage_of: Sequence[int] | None = None
) -> dict:
    """``{key: stage_value(...)}`` for each of ``keys``: one stage's figures, as data."""
    return {key: stage_value(gathered, stage, key, stage_of=stage_of) for key in keys}


@lru_cache(maxsize=32)
def _per_stage_slots(keys: tuple, patterns: tuple) -> tuple:
    return tuple(i for i, key in enumerate(keys) if any(fnmatchcase(key, p) for p in patterns))


def _column(keys, per_rank, name):
    if name not in keys:
        return None
    slot = keys.index(name)
    return [values[slot] for values in per_rank]


def _headroom(keys, per_rank) -> dict:
    out = {}
    totals = _column(keys, per_rank, DEVICE_TOTAL.key)
    reserved = _column(keys, per_rank, PEAK_RESERVED.key)
    # Memory outside the allocator (CUDA context, NCCL, other processes) is not free for it.
    other = _column(keys, per_rank, DEVICE_OTHER.key) or [None] * len(per_rank)
    if totals and reserved:
        stages = [
            (t - (o or 0.0) - r, stage, r / t)
            for stage, (t, r, o) in enumerate(zip(totals, reserved, other))
            if t is not None and r is not None and t > 0
        ]
        if stages:
            headroom, stage, used = min(stages)
            out.update(
                {
                    PREFIX + HEADROOM.key: headroom,
                    PREFIX + HEADROOM_STAGE.key: stage,
                    PREFIX + PEAK_RESERVED_PCT.key: 100.0 * used,
                }
            )
    out.update(_host_headroom(keys, per_rank))
    return out


def _host_headroom(keys, per_rank) -> dict:
    """Per stage: MemAvailable, or the smaller of it and (limit - usage) of its memory cgroup."""
    out = {}
    none = [None] * len(per_rank)
    available = _column(keys, per_rank, HOST_AVAILABLE.key) or none
    limits = _column(keys, per_rank, HOST_LIMIT.key) or none
    used = _column(keys, per_rank, HOST_LIMIT_USED.key) or none
    left = []
    for stage, (a, limit, u) in enumerate(zip(available, limits, used)):
        to_limit = None if limit is None or u is None else limit - u
        candidates = [v for v in (a, to_limit) if v is not None]
        if candidates:
            left.append((min(candidates), stage))
    if left:
        headroom, stage = min(left)
        out.update({PREFIX + HOST_HEADROOM.key: headroom, PREFIX + HOST_HEADROOM_STAGE.key: stage})
    host_totals = _column(keys, per_rank, HOST_TOTAL.key) or none
    rss = _column(keys, per_rank, PEAK_HOST_RSS.key)
    if rss:
        shares = [
            100.0 * r / (limit or total)
            for total, limit, r in zip(host_totals, limits, rss)
            if (limit or total) and r is not None
        ]
        if shares:
            out[PREFIX + PEAK_HOST_RSS_PCT.key] = max(shares)
    return out


# kind, headroom key, capacity key, stage key, how to say it
_HEADROOM_KINDS = (
    (
        "device",
        HEADROOM.key,
        DEVICE_TOTAL.key,
        HEADROOM_STAGE.key,
        "pipeline stage {stage} has {left:.2f} GB of device memory left ({pct:.1f}% of {total:.1f} GB): "
        "close to CUDA OOM",
    ),
    (
        "host",
        HOST_HEADROOM.key,
        HOST_TOTAL.key,
        HOST_HEADROOM_STAGE.key,
        "pipeline stage {stage}'s node has {left:.2f} GB of RAM available ({pct:.1f}% of {total:.1f} GB): "
        "close to the OOM killer (SIGKILL)",
    ),
)


_LIMIT_SENTENCE = (
    "pipeline stage {stage} has {left:.2f} GB left before its memory cgroup's limit ({pct:.1f}% of "
    "{total:.1f} GB): close to the OOM killer (SIGKILL)"
)


def low_headroom(metrics: dict, fraction: float) -> list[tuple[str, int, str]]:
    """(kind, stage, sentence) for each headroom below ``fraction`` of capacity."""
    found = []
    limit = metrics.get(PREFIX + HOST_LIMIT.key)
    for kind, left_key, total_key, stage_key, sentence in _HEADROOM_KINDS:
        left, total = metrics.get(PREFIX + left_key), metrics.get(PREFIX + total_key)
        if kind == "host" and limit is not None and limit == limit:  # a cgroup limit binds first
            total, sentence = limit, _LIMIT_SENTENCE
        if left is not None and total and left < fraction * total:
            stage = metrics[PREFIX + stage_key]
            found.append((kind, stage, sentence.format(stage=stage, left=left, pct=100 * left / total, total=total)))
    return found


class Coordinates(NamedTuple):
    """Where a rank sits in the job: its global rank and its pipeline, tensor and data-parallel ranks."""

    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int


def world_metrics(
    gathered: GatheredMemory, per_stage_patterns: Iterable[str] = ("peak_*",), coordinates: Sequence = ()
) -> dict:
    """Metrics for memory_reduce_scope="world": positions are global ranks, ``coordinates[r]``
    (a ``Coordinates``) says where position r sits (gathered once, when the run was placed). Adds
    where each maximum lives: memory/peak_rank/<name>, memory/peak_tp_rank/<name>,
    memory/peak_dp_rank/<name>; pp_stage_{i} values are the max over that stage's ranks."""
    keys = gathered.keys
    per_rank = gathered.per_rank
    stage_of = [where.pp_rank for where in coordinates]
    out = {}
    for key, value in gathered.maximum.items():
        if key == HOST_AVAILABLE.key:
            continue
        out[PREFIX + key] = value
        if key in CAPACITY:
            continue
        where = coordinates[gathered.peak_rank[key]]
        out[f"{PREFIX}peak_stage/{key}"] = where.pp_rank
        out[f"{PREFIX}peak_rank/{key}"] = where.rank
        out[f"{PREFIX}peak_tp_rank/{key}"] = where.tp_rank
        out[f"{PREFIX}peak_dp_rank/{key}"] = where.dp_rank
    for slot in _per_stage_slots(keys, tuple(per_stage_patterns)):
        for stage in sorted(set(stage_of)):
            present = [v[slot] for v, s in zip(per_rank, stage_of) if s == stage and v[slot] is not None]
            if present:
                out[f"{PREFIX}pp_stage_{stage}/{keys[slot]}"] = max(present)
    for name, value in _headroom(keys, per_rank).items():
        if name.endswith("_stage"):  # positions are ranks here: name the stage, keep the rank
            out[name.removesuffix("_stage") + "_rank"] = coordinates[value].rank
            value = stage_of[value]
        out[name] = value
    return out
