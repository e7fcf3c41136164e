"""The post-mortem as JSON, for a failure hook: ``nemo-memlog postmortem --json``.

Reads a ``postmortem.Postmortem`` (no file); ``json_text`` returns the document the command
prints (schema in docs/postmortem.md), strict JSON: no NaN, no Infinity.
"""

from __future__ import annotations

import json
from typing import Any

from ...keys import HEADROOM, HOST_AVAILABLE, HOST_LIMIT, HOST_LIMIT_USED, HOST_RSS, HOST_TOTAL, PEAK_RESERVED
from ..tables import iso_time
from . import allowance_s
from .sentence import fragmented, sentence, stopped_after_first
from .state import Postmortem, RankState

_OOM_KEYS = (
    "time",
    "iteration",
    "device",
    "bytes_requested",
    "device_limit",
    "device_free",
    "reserved_free",
    "largest_free_block",
    "snapshot",
)


def json_text(postmortem: Postmortem, png: str | None = None) -> str:
    """``to_json`` as indented JSON text, every non-finite number written as null."""
    return json.dumps(finite(to_json(postmortem, png)), indent=1)


def to_json(postmortem: Postmortem, png: str | None = None) -> dict:
    """The machine-readable post-mortem (schema in docs/postmortem.md) as plain JSON values."""
    first = postmortem.first_failure
    failure = None
    if first is not None:
        failure = _rank_json(first) | {
            "time": first.failure_time,
            "time_exact": first.failure_time_exact,
            "sentence": sentence(postmortem),
            "fragmentation": bool(first.oom and fragmented(first.oom)),
            "ambiguous_with": [
                {
                    "rank": s.rank,
                    "status": s.status,
                    "host": s.host,
                    "time": s.failure_time,
                    "allowance_s": allowance_s(first, s, postmortem.clock_skew_s),
                }
                for s in (postmortem.ambiguity.others if postmortem.ambiguity else [])
            ],
        }
    return {
        "run_dir": str(postmortem.run_dir),
        "run_id": postmortem.run_id,
        "world_size": postmortem.world_size,
        "sentence": sentence(postmortem),
        "first_failure": failure,
        "failed_ranks": [s.rank for s in postmortem.failures],
        "died_of_first_failure": [s.rank for s in postmortem.victims],
        "ranks": [
            _rank_json(s) | {"stopped_after_first_s": stopped_after_first(postmortem, s)} for s in postmortem.ranks
        ],
        "missing_ranks": postmortem.missing_ranks,
        "unreadable_files": [
            {"path": str(path), "rank": rank, "error": why} for path, rank, why in postmortem.unreadable
        ],
        "ignored_runs": postmortem.ignored_runs,
        "duplicate_files": postmortem.duplicates,
        "notes": postmortem.notes,
        "clock_skew_s": postmortem.clock_skew_s,
        "png": png,
    }


def _rank_json(state: RankState) -> dict:
    """One rank's entry of ``ranks`` (and the base of ``first_failure``)."""
    header = state.header
    oom = None
    if state.oom is not None:
        oom = {key: state.oom.get(key) for key in _OOM_KEYS} | {"fragmentation": fragmented(state.oom)}
    return {
        "rank": state.rank,
        "pp_rank": header.get("pp_rank"),
        "tp_rank": header.get("tp_rank"),
        "dp_rank": header.get("dp_rank"),
        "host": state.host,
        "pid": header.get("pid"),
        "status": state.status,
        "end_reason": state.end_reason,
        "end_detail": (state.end or {}).get("detail"),
        "last_iteration": state.last_iteration,
        "last_alive": state.last_alive,
        "last_alive_iso": iso_time(state.last_alive),
        "stopped": state.failure_time,
        "died_of": None if state.died_of is None else state.died_of.rank,
        "phase": state.open_phase,
        PEAK_RESERVED.key: state.peak_reserved_gb,
        HEADROOM.key: state.headroom_gb,
        HOST_RSS.key: state.live(HOST_RSS.key),
        HOST_AVAILABLE.key: state.live(HOST_AVAILABLE.key),
        HOST_TOTAL.key: state.value(HOST_TOTAL.key),
        HOST_LIMIT.key: state.live(HOST_LIMIT.key),
        HOST_LIMIT_USED.key: state.live(HOST_LIMIT_USED.key),
        "probable_host_oom_kill": state.probable_host_oom_kill,
        "host_oom_kill_evidence": state.host_oom_kill_evidence,
        "oom": oom,
        "problems": state.file.problems,
        "file": str(state.file.path),
    }


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, Infinity: strict parsers refuse them) made None."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value
