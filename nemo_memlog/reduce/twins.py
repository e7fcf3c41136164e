"""The gloo twins: gloo groups of the same ranks as a group, to gather memory off the GPU.

Creating a group is a collective over the whole world: every rank runs these at once, with
the same arguments, and creates the same groups in the same order (``Reduction.group_for``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .channel import Channel, timedelta_of
from .protocol import MemoryReduceError


def world_twin(timeout_s: float | None) -> tuple:
    """(a gloo group of every rank, [it]): the world scope's twin, and what was created."""
    twin = _new_gloo_group(None, timeout_s)
    return twin, [twin]


def pp_twin(group: dist.ProcessGroup | None, world: dist.ProcessGroup, timeout_s: float | None) -> tuple:
    """(this rank's twin, [the group created that holds this rank]). Every rank names its
    group by its lowest global rank (-1: no group, or one of one); the same gathered names
    give every rank the same partition and creation order."""
    ranks = dist.get_process_group_ranks(group) if group is not None and group.size() > 1 else []
    mine = min(ranks) if ranks else -1
    names = Channel(world).gather_small(torch.tensor([mine], dtype=torch.int64), world, None, timeout_s)
    twin, created = group, []
    for name in sorted(set(names) - {-1}):
        members = [rank for rank, named in enumerate(names) if named == name]
        made = _new_gloo_group(members, timeout_s)
        if name == mine:
            created.append(made)
            twin = made if members == sorted(ranks) else group  # not a partition: keep the group
    return twin, created


def _new_gloo_group(ranks, timeout_s):
    try:
        return dist.new_group(ranks, backend="gloo", timeout=None if timeout_s is None else timedelta_of(timeout_s))
    except Exception as error:  # gloo cannot connect (an interface it cannot reach, say)
        raise MemoryReduceError(
            f"creating a gloo group of ranks {ranks or 'all'} for the memory gather failed ({error}). "
            f"Set memory_reduce_backend='group' to gather over the group itself (on NCCL: on the GPU), "
            f"or point gloo at a reachable interface (GLOO_SOCKET_IFNAME)."
        ) from error
