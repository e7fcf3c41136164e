"""What a rank waiting in a collective can see of its peers: their flight records' liveness slots
(recorder.py rewrites each about once a second with the last step the rank recorded, which it
records before it joins that step's collective). Reads only the small header and liveness slots of
regular files in the record folder this rank writes into; no collective; never raises."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from . import records


def not_arrived(directory: str | os.PathLike[str] | None, ranks: list[int], iteration: int | None) -> list[str]:
    """Each rank of ``ranks`` that, by its flight record, has not reached ``iteration``'s logging step,
    with why ("last recorded step 8", "silent for 42 s", "no flight record in <dir>")."""
    if directory is None or iteration is None:
        return []
    behind = []
    now = time.time()
    for rank in ranks:
        said = _where(Path(directory) / records.file_name(rank), iteration, now)
        if said is not None:
            behind.append(f"rank {rank} ({said})")
    return behind


def _where(path: Path, iteration: int, now: float) -> str | None:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return f"{path.name} is not a regular file"
        with open(path, "rb") as file:
            head = file.read(records.RECORDS_AT)
        liveness = records.decode(head[records.HEADER_BYTES : records.RECORDS_AT]) or {}
    except FileNotFoundError:
        return f"no flight record in {path.parent} (another node's folder, or it never logged)"
    except (OSError, records.RecordError) as error:
        return f"its flight record cannot be read: {error}"
    last = liveness.get("iteration")
    alive = liveness.get("alive")
    silent = now - alive if isinstance(alive, (int, float)) else None
    if isinstance(last, int) and last >= iteration:
        return None  # it recorded this step: it is in the collective (or on its way)
    parts = [f"last recorded step {last}" if isinstance(last, int) else "no step recorded yet"]
    if silent is not None and silent > 10:
        parts.append(f"its process silent for {silent:.0f} s")
    return ", ".join(parts)


def stall_message(iteration: int | None, waited_s: float, ranks: int, behind: list[str], timeout_s: float) -> str:
    """The warning of a reduction still waiting: how long, who is late by their records, what next."""
    if behind:
        who = f"not arrived by their flight records: {', '.join(behind[:16])}"
        who += f" and {len(behind) - 16} more" if len(behind) > 16 else ""
    else:
        who = "no flight record here names the late ranks (memory_record_dir off, or another node's folder)"
    return (
        f"memory reduction at iteration {iteration} has waited {waited_s:.0f} s for the other ranks of its group "
        f"({ranks or '?'} ranks); {who}. It keeps waiting up to memory_reduce_timeout_s={timeout_s:g}s "
        f"(memory_reduce_stall_warn_s sets when this is said)."
    )
