"""Who wrote a flight record: the run id every rank agrees on, and this rank's coordinates.

The header of a rank's file (records.py) names the run, the rank and its place in the job,
so the post-mortem can tell one run's files from another's and lay the ranks out by stage.
No collective, ever: the run id is agreed through the default store's compare_set (the
other ranks may already be stuck in a collective when it matters), and the coordinates are
read from groups that already exist.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

#: The store key every rank of one run agrees on its run id through (compare_set: no collective).
RUN_ID_KEY = "nemo_memlog/run_id"


def identity(pp_group: ProcessGroup | None = None, pg_collection: Any = None) -> dict:
    """The header's who-am-I: ``run_id``, global ``rank`` and ``world_size``, ``pp_rank``,
    ``tp_rank``, ``dp_rank`` (megatron-core's parallel_state where initialised, else 0) and
    ``host``. Without torch.distributed: RANK and WORLD_SIZE from the environment. Never raises
    for want of a group."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    try:
        from ..rank.megatron import coordinates

        coords = coordinates(pp_group, pg_collection) if distributed else {"pp": 0, "tp": 0, "dp": 0}
    except Exception:  # the header must not fail for want of a group
        coords = {"pp": 0, "tp": 0, "dp": 0}
    return {
        "run_id": run_id(),
        "rank": dist.get_rank() if distributed else int(os.environ.get("RANK", 0)),
        "world_size": dist.get_world_size() if distributed else int(os.environ.get("WORLD_SIZE", 1)),
        "pp_rank": coords["pp"],
        "tp_rank": coords["tp"],
        "dp_rank": coords["dp"],
        "host": socket.gethostname(),
    }


def run_id() -> str:
    """The same id on every rank of one run, with no collective: the first rank to ask sets it in
    torch.distributed's default store (an atomic compare_set), every rank reads that value.
    Without a store: TORCHELASTIC_RUN_ID, SLURM's job (and step) id, else the rendezvous
    address with today's date."""
    store = default_store()
    if store is not None:
        try:
            return store.compare_set(RUN_ID_KEY, "", uuid.uuid4().hex).decode()
        except Exception:  # a store that lacks compare_set, or is gone: the environment's ids below
            pass
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return env["TORCHELASTIC_RUN_ID"]
    if env.get("SLURM_JOB_ID"):
        return env["SLURM_JOB_ID"] + (f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else "")
    if env.get("MASTER_ADDR"):
        return f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '')}@{time.strftime('%Y-%m-%d')}"
    return uuid.uuid4().hex  # a single process: its own run


def default_store() -> Store | None:
    """torch.distributed's default store, or None (not initialised, or a torch without one).
    torch offers no public accessor; this is the one place that reaches for its private one."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if dist.is_available() and dist.is_initialized():
            return distributed_c10d._get_default_store()
    except Exception:
        pass
    return None
