"""The job's shape: the pipeline-parallel group and this rank's coordinates, from megatron-core (never
importing it where nothing did), and what a launch without a process group means."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Hashable
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


#: The note of a job of several ranks with no pipeline group known (MemoryMonitor.place).
NO_PIPELINE_GROUP = (
    "no pipeline-parallel group is known in this job of {world} ranks (no pp_group=, no pg_collection=, and "
    "megatron-core's parallel_state is not initialised): memory is reduced over the whole world instead, as with "
    "memory_reduce_scope='world' (memory/peak_rank/<name> names the rank of each max). To reduce over each "
    "pipeline, pass pp_group= (the pipeline's torch.distributed group) or pg_collection= (with .pp), or call "
    "megatron-core's parallel_state.initialize_model_parallel(...) before the first logging step; or set "
    "memory_reduce_scope='world' to reduce over the whole world without this note."
)


def check_launch(warn: Callable[[Hashable, str], None]) -> None:
    """A process a launcher started as one of several, logging with no process group.

    Under torchrun or a SLURM script with ``WORLD_SIZE`` > 1, each process would log itself as a
    one-stage job into the same dashboards: pipeline peaks that are wrong in the way this tool
    exists to fix, and never a setup that works, so it raises before the first write. ``RANK``
    set with no larger world (``--nproc-per-node 1``) is only odd: ``warn(key, text)`` once."""
    world = os.environ.get("WORLD_SIZE", "")
    fix = (
        "call torch.distributed.init_process_group() (and megatron-core's "
        "parallel_state.initialize_model_parallel for pipeline stages) before the first training_log"
    )
    if world.isdigit() and int(world) > 1:
        raise RuntimeError(
            f"nemo_memlog: WORLD_SIZE={world} and RANK={os.environ.get('RANK', '?')} say a launcher started "
            f"{world} processes, but torch.distributed is not initialised: each would log itself as a one-stage "
            f"job into the same dashboards. {fix[0].upper()}{fix[1:]}."
        )
    if "RANK" in os.environ:
        warn(
            ("launch",),
            f"RANK={os.environ['RANK']} is set but torch.distributed is not initialised: logging as a one-process "
            f"job. If this process is one of several, {fix}.",
        )
