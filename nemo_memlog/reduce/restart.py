"""The close_writers() restart agreement: before a run that follows a ``close_writers()`` enters
its first collective, every rank of its group must have ended its runs as often. Store keys
only, no collective.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from ..failure.identity import default_store
from .protocol import MemoryReduceError
from .state import PROCESS

#: Where each global rank publishes, in the default store, how many times ``close_writers()``
#: ended its runs (no collective: a store key each).
RUNS_ENDED_KEY = "nemo_memlog/runs_ended/{rank}"


def runs_ended() -> None:
    """This rank's runs were ended by ``close_writers()``: count it, and say so in the store."""
    PROCESS.runs_ended += 1
    store = default_store()
    if store is not None:
        store.set(RUNS_ENDED_KEY.format(rank=dist.get_rank()), str(PROCESS.runs_ended))


def agree_on_restart(group: dist.ProcessGroup | None, timeout_s: float) -> None:
    """Before a run that follows a ``close_writers()`` enters its first collective: wait (bounded
    by ``timeout_s``) until every rank of ``group`` has ended its runs as often as this one, so a
    call made on one rank only raises here, naming the ranks, instead of a collective of different
    shapes that gloo answers by aborting the process. Store reads only; nothing on a first run."""
    store = default_store()
    if not PROCESS.runs_ended or store is None or group is None:
        return
    ranks = dist.get_process_group_ranks(group)
    deadline = time.monotonic() + timeout_s
    while True:
        behind = [rank for rank in ranks if _ended_on(store, rank) != PROCESS.runs_ended]
        if not behind:
            return
        if time.monotonic() > deadline:
            raise MemoryReduceError(
                f"close_writers() has ended this rank's runs {PROCESS.runs_ended} time(s), but global rank(s) {behind} "
                f"of its group have not after {timeout_s:g} s: it ends the runs on the rank that calls it, so "
                f"call it on every rank at the same point of the loop (or on none) before logging again"
            )
        time.sleep(0.01)


def _ended_on(store, rank: int) -> int:
    key = RUNS_ENDED_KEY.format(rank=rank)
    return int(store.get(key)) if store.check([key]) else 0
