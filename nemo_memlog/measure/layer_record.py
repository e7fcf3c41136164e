"""The per-layer record: what each layer of a rank's stage holds, one JSON file per rank beside its
flight record. Pure format, read and written here; no torch, no collective.

``<record dir>/rank-<global rank, 5 digits>.layers.json``, rewritten (atomically: a temporary file,
then a rename) at each logging step whose activations were measured (measure/activations.py)::

    {"format": "nemo_memlog.layers", "version": 1, "rank": int, "world_size": int,
     "pp_rank": int, "pp_size": int, "tp_rank": int, "tp_size": int, "dp_rank": int, "dp_size": int,
     "iteration": int, "measured_steps": int (this rank's measured logging steps so far: nemo-memlog
     fit ends a probe at two), "time": float (unix time),
     "host_cgroup": "<host>:<cgroup folder>" (under a memory cgroup limit only: the ranks naming
                    the same one share its charge, nemo_memlog/offline/node_charge.py),
     "run": {...}   the run's facts, as known: "microbatches", "micro_batch_size", "optimizer",
                    "distributed_optimizer", ... (absent where unknown),
     "stage": {"params_gb", "grads_gb", "optimizer_state_gb", "model_state_gb", "activations_gb",
               "activations_per_microbatch_gb", "microbatches_in_flight", "microbatches",
               "chunks"; under a memory cgroup limit "host_limit_gb", "host_limit_used_gb" (its
               charge now), "host_limit_peak_gb" (its own peak charge: v1 memory.max_usage_in_bytes,
               v2 memory.peak, where the kernel has it), "host_rss_gb" (this rank's RSS now);
               on CPU also "host_idle_rss_gb" (measure/host_idle.py); on a GPU also
               "peak_allocated_gb", "peak_reserved_gb", "temporaries_gb", "allocator_slack_gb",
               "device_other_gb", "device_total_gb"},
     "layers": [{"name": str, "kind": "layer"|"embedding"|"output"|"other", "chunk": int,
                 "number": int|null, "params_gb", "grads_gb", "optimizer_state_gb",
                 "activations_per_microbatch_gb", "input_per_microbatch_gb"}, ...]}

GB are 1e9 bytes. ``layers`` lists the stage's layers in forward order, chunk by chunk, then one
"other" entry: what no layer owns (a final norm, the loss, a flat buffer's padding is in neither:
the stage's figures count storages whole). A layer's activations are the bytes first saved while
it was the innermost layer running, per microbatch it ran in; its input is the storages of its tensor
arguments, positional or keyword (hidden states, masks, rotary embeddings), what full recompute keeps
of it, a storage several layers take (a mask) counted once, at the first.
"""

from __future__ import annotations

import json
import numbers
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..keys import HOST_RSS

if TYPE_CHECKING:
    from ..bounded import ReadBudget

FORMAT = "nemo_memlog.layers"
VERSION = 1
_NAME = re.compile(r"^rank-(\d+)\.layers\.json$")
#: The largest file read as a record (a stage of thousands of layers is a few MB).
MAX_BYTES = 64 << 20


def file_name(rank: int) -> str:
    return f"rank-{rank:05d}.layers.json"


def rank_of(name: str) -> int | None:
    """The global rank a record file's name gives (``file_name``'s inverse), or None for another file."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def step_record(
    layout: Mapping[str, Any],
    *,
    iteration: int,
    time: float,
    facts: Mapping[str, Any],
    stage_and_rows: Mapping[str, Any],
    measured_steps: int,
) -> dict:
    """One measured logging step's record, as ``write`` takes it.

    Args:
        layout: the job's sizes and this rank's place (rank, world_size, pp/tp/dp ranks and sizes).
        iteration: the logging iteration.
        time: its unix time.
        facts: the run's facts, as known.
        stage_and_rows: ``{"stage": {...}, "layers": [...]}`` (measure/layer_rows.stage_and_rows).
        measured_steps: this rank's measured logging steps so far, this one included.
    """
    record = {**layout, "iteration": iteration, "time": time, "run": dict(facts), **stage_and_rows}
    record["measured_steps"] = measured_steps
    return record


def cgroup_figures(report: Mapping[str, Any], peak_gb: float) -> dict:
    """The figures a rank under a memory limit adds to its stage: its RSS now (``host_rss_gb``) and
    its cgroup's own peak charge (``host_limit_peak_gb``, where the kernel keeps one: NaN left out)."""
    figures = {HOST_RSS.key: report[HOST_RSS.key]}
    if peak_gb == peak_gb:
        figures["host_limit_peak_gb"] = peak_gb
    return figures


def write(folder: str | os.PathLike[str], record: dict) -> Path:
    """Write ``record`` (its ``rank`` names the file) into ``folder``, atomically; returns the path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(int(record["rank"]))
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    whole = {"format": FORMAT, "version": VERSION, **record}
    try:
        text = json.dumps(whole, allow_nan=True)
    except (TypeError, ValueError):  # a value JSON cannot encode (a fact): written as its text, never dropped
        text = json.dumps(json_safe(whole), allow_nan=True)
    temporary.write_text(text)
    os.replace(temporary, path)
    return path


def read_rank(folder: str | os.PathLike[str], rank: int) -> dict | None:
    """Rank ``rank``'s record in ``folder``, or None where it has none (or it cannot be read)."""
    try:
        return _checked(Path(folder) / file_name(rank))
    except (OSError, ValueError):
        return None


def read_folder(folder: str | os.PathLike[str]) -> list[dict]:
    """Every rank's record in ``folder``, by rank; a file that cannot be read (not a regular file,
    over MAX_BYTES, not JSON, not a record, a newer version) raises ValueError naming the file and
    what is wrong."""
    return [record for _, record in read_folder_files(folder)]


def read_folder_files(folder: str | os.PathLike[str], budget: ReadBudget | None = None) -> list[tuple[Path, dict]]:
    """``read_folder``, each record with its file, by rank. ``budget``: what the command may still
    read of the run's files together (default: bounded.RUN_READ_BYTES for these alone); the files
    over it raise ValueError before any is read."""
    from ..bounded import ReadBudget, Refused

    budget = ReadBudget() if budget is None else budget
    paths = [path for path in sorted(Path(folder).glob("rank-*.layers.json")) if _NAME.match(path.name)]
    try:
        budget.reserve(paths, "per-layer records", MAX_BYTES)
    except Refused as error:
        raise ValueError(f"{folder}: {error}") from None
    records = []
    for path in paths:
        try:
            records.append((path, _checked(path)))
        except OSError as error:
            raise ValueError(f"{path}: cannot be read ({error.strerror or error})") from None
        budget.read_one()
    return sorted(records, key=lambda item: _rank_key(item[1]))


def _rank_key(record: dict) -> tuple:
    rank = record.get("rank")
    return (0, rank) if isinstance(rank, int) and not isinstance(rank, bool) else (1, 0)


def _checked(path: Path) -> dict:
    """The record in ``path``; ValueError naming the file when it is not one this reader can use.
    Reads regular files only (a FIFO named like a record would wait forever, /dev/zero never ends),
    at most MAX_BYTES."""
    from ..bounded import Refused, load_json, read_regular

    try:
        record = load_json(read_regular(path, MAX_BYTES))
    except Refused as error:
        raise ValueError(f"{path}: {error}") from None
    except ValueError as error:  # JSON or UTF-8
        raise ValueError(f"{path}: not a per-layer record: not JSON ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: not a per-layer record: JSON {type(record).__name__}, not an object")
    if record.get("format") != FORMAT:
        raise ValueError(f"{path}: not a nemo_memlog per-layer record (format {record.get('format')!r})")
    version = record.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"{path}: field 'version': {version!r} is not a whole number")
    if version > VERSION:
        raise ValueError(
            f"{path}: per-layer record version {record['version']}, newer than this nemo_memlog reads "
            f"({VERSION}): upgrade nemo_memlog"
        )
    return record


def json_safe(value: Any) -> Any:
    """``value`` as JSON encodes it: dicts (string keys), lists, bools, ints, floats (NaN and the
    infinities as JSON's extension writes them), strings, None; anything else its ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return str(value)
