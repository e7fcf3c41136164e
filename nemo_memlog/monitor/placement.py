"""Where a run sits in the job: the group it reduces over, the job's layout, and who writes.

Resolved once per run, at its first logging step (when the process groups surely exist), on
every rank at the same time: the gloo twin of the group is created here, a collective over the
whole world (reduce.reduction_group).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..attribution import Coordinates
from ..config import Settings
from ..rank import megatron
from ..reduce import Reduction, agree_on_restart


@dataclass
class Placement:
    """This rank's place in the job, as its run reduces and writes.

    Args:
        group: the group the run reduces over (its gloo twin where it has one); None without
            torch.distributed.
        world: whether every rank is reduced together (the ``world`` scope, or a job of several
            ranks with no pipeline group known).
        coordinates: with ``world``, where each position of the group sits (gathered once).
        is_writer_rank: whether this rank hands the steps to the writers.
        layout: the job's sizes as the per-layer record states them (rank, world_size,
            local_world_size, pp/tp/dp sizes).
    """

    group: Any
    world: bool
    is_writer_rank: bool
    layout: dict
    coordinates: list[Coordinates] = field(default_factory=list)

    @property
    def stage_of(self) -> list[int] | None:
        """With ``world``, the pipeline stage of each position of the group; else None."""
        return [where.pp_rank for where in self.coordinates] if self.world else None


def place(
    settings: Settings,
    reduction: Reduction,
    groups: tuple[Any, Any],
    writer_rank: int | None,
    warn_once: Callable[[Hashable, str], None],
) -> Placement:
    """Resolve this rank's group and place in the job. Every rank of the job calls it at once.

    With the ``pp`` scope, a job of several ranks and no pipeline group known (no ``pp_group``,
    no ``pg_collection``, megatron-core's parallel_state not initialised) is reduced over the
    whole world, as the ``world`` scope, with a note on the writer rank, once, saying how to give
    the group: every rank decides alike, from the same inputs.

    Args:
        settings: the run's settings.
        reduction: the run's reduction state (its channels and gloo twins).
        groups: ``(pp_group, pg_collection)`` as the run was given them (either may be None).
        writer_rank: the global rank that writes; None: the last, where Megatron logs.
        warn_once: the run's once-only warning.

    Raises:
        ValueError: ``writer_rank`` is not a rank of this job (every rank raises alike, before
            any collective).
    """
    pp_group, pg_collection = groups
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    if not distributed:
        megatron.check_launch(warn_once)
    pipeline = None if settings.world_scope else megatron.pipeline_group(pp_group, pg_collection)
    no_group = pipeline is None and distributed and world_size > 1
    world = settings.world_scope or no_group
    if world:
        group = dist.group.WORLD if distributed else None
        coords = megatron.coordinates(pp_group, pg_collection)
        mine = (dist.get_rank() if distributed else 0, coords["pp"], coords["tp"], coords["dp"])
    else:
        group = pipeline
    # On NCCL jobs, by default, a gloo group of the same ranks: memory logging off the GPU stream.
    if distributed:  # a run after close_writers(): every rank of the group restarted too
        agree_on_restart(group or dist.group.WORLD, settings.memory_reduce_timeout_s)
    group = reduction.group_for(
        group,
        backend=settings.memory_reduce_backend,
        world_scope=world,
        timeout_s=settings.memory_reduce_timeout_s,
    )
    coordinates = []
    if world:  # where each position sits, gathered once: the steps carry memory only
        gathered = reduction.gather_ints(group, mine, settings.memory_reduce_timeout_s)
        coordinates = [Coordinates(*where) for where in gathered]
    is_writer_rank = not distributed or dist.get_rank() == _writer_rank(writer_rank, world_size)
    if no_group and is_writer_rank:
        warn_once(("no-pipeline-group",), megatron.NO_PIPELINE_GROUP.format(world=world_size))
    layout = {
        "rank": dist.get_rank() if distributed else 0,
        "world_size": world_size,
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
        **megatron.layout(pp_group, pg_collection),
    }
    return Placement(group, world, is_writer_rank, layout, coordinates)


def _writer_rank(writer_rank: int | None, world_size: int) -> int:
    if writer_rank is None:
        return world_size - 1
    if not 0 <= writer_rank < world_size:  # every rank raises alike: no collective has run yet
        raise ValueError(f"writer_rank={writer_rank} is not a rank of this job (world size {world_size})")
    return writer_rank
