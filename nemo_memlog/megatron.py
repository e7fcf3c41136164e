"""Finding the pipeline-parallel group (and a rank's coordinates) from megatron-core."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def pipeline_group(pp_group: ProcessGroup | None = None, pg_collection: Any = None) -> ProcessGroup | None:
    """``pp_group``; else ``pg_collection.pp``; else megatron-core's parallel_state group
    when it is initialised; else None (no reduction)."""
    if pp_group is not None:
        return pp_group
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        return pg_collection.pp
    parallel_state = _parallel_state()
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_pipeline_model_parallel_group()
    return None


def coordinates(pp_group: ProcessGroup | None = None, pg_collection: Any = None) -> dict[str, int]:
    """This rank's (pp, tp, dp) ranks, from the groups at hand (0 where unknown)."""
    return {name: rank for name, (rank, _) in _places(pp_group, pg_collection).items()}


def layout(pp_group: ProcessGroup | None = None, pg_collection: Any = None) -> dict[str, int]:
    """This rank's place and the job's sizes: ``pp_rank``, ``pp_size``, ``tp_rank``,
    ``tp_size``, ``dp_rank``, ``dp_size`` (rank 0 and size 1 where a group is unknown)."""
    out = {}
    for name, (rank, size) in _places(pp_group, pg_collection).items():
        out[f"{name}_rank"], out[f"{name}_size"] = rank, size
    return out


def _places(pp_group, pg_collection) -> dict[str, tuple[int, int]]:
    import torch.distributed as dist

    groups = {"pp": pipeline_group(pp_group, pg_collection)}
    parallel_state = _parallel_state()
    initialised = parallel_state is not None and parallel_state.model_parallel_is_initialized()
    groups["tp"] = getattr(pg_collection, "tp", None) or (
        parallel_state.get_tensor_model_parallel_group() if initialised else None
    )
    groups["dp"] = getattr(pg_collection, "dp", None) or (
        parallel_state.get_data_parallel_group() if initialised else None
    )
    return {
        name: (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        for name, group in groups.items()
    }


def _parallel_state():
    # Initialised groups mean an imported module: looking it up in sys.modules never imports
    # megatron-core (seconds, and warnings) into a job that does not use it. Optional: plain
    # torch groups work too.
    return sys.modules.get("megatron.core.parallel_state")
