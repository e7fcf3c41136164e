"""The public helpers: Megatron-Bridge's ``reduce_max_memory_across_pp_group``, and the free
functions (``gather_memory``, ``single_rank``, ``reduction_group``) that share the process's
Reduction (``PROCESS.shared``), with ``takes_part`` and ``twin_for``.
"""

from __future__ import annotations

import torch.distributed as dist

from ..attribution import GatheredMemory
from ..config import default_of
from .state import PROCESS

#: How long a helper call waits for the other ranks: LoggerConfig's memory_reduce_timeout_s default.
DEFAULT_TIMEOUT_S = default_of("memory_reduce_timeout_s")


def reduce_max_memory_across_pp_group(
    memory_report: dict, pp_group: dist.ProcessGroup | None, *, timeout_s: float | None = DEFAULT_TIMEOUT_S
) -> dict:
    """Return the per-key maximum of ``memory_report`` over ``pp_group``, on every rank of it.

    Megatron-Bridge's function, same contract. A collective: every rank of the group calls
    it with the same keys. Runs on gloo and NCCL groups alike.

    Args:
        memory_report: this rank's ``{name: number}`` (``report_memory()``'s). Not mutated.
            NaN or None marks a value this rank lacks; a value that is not a number warns
            once and counts as lacking.
        pp_group: the group to reduce over.
        timeout_s: how long to wait for the other ranks (default: LoggerConfig's
            ``memory_reduce_timeout_s`` default); None waits forever.

    Returns:
        A new dict: ints stay ints (exact in the int64 range), floats stay floats; a key
        every rank lacks is dropped. ``memory_report`` itself, with no collective, when it
        is empty, torch.distributed is unavailable or not initialised, or ``pp_group`` is
        None, has size 1 or has no callable ``size``.

    Raises:
        MemoryReduceError: the ranks pass different keys (every rank raises, naming them),
            or some rank did not join within ``timeout_s`` or left (a rank that took a no-op
            path above while the others reduce leaves them to this).
    """
    if pp_group is None or not takes_part(memory_report, pp_group):
        return memory_report
    # A MemoryMonitor placed in this job made a gloo twin of this group: same ranks, same
    # result, and no GPU work. Without one, the group itself (this helper creates no group:
    # that is a collective over the whole world, which its callers do not promise to enter).
    twin = twin_for(pp_group)
    return gather_memory(memory_report, pp_group if twin is None else twin, timeout_s=timeout_s).maximum


def takes_part(memory_report: dict, group: dist.ProcessGroup | None) -> bool:
    """Whether a reduction over ``group`` would run a collective (same answer on every rank)."""
    if not memory_report or group is None:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return False
    size = getattr(group, "size", None)
    return callable(size) and size() > 1


def gather_memory(
    memory_report: dict,
    group: dist.ProcessGroup,
    *,
    iteration: int | None = None,
    interval: int | None = None,
    timeout_s: float | None = None,
) -> GatheredMemory:
    """Gather every rank's report over ``group`` and line the reports up by key.

    A collective: every rank of ``group`` calls it. Call it only where ``takes_part`` is
    true (torch.distributed initialised, a group of more than one rank, a non-empty report).

    Args:
        memory_report: this rank's ``{name: number}``. Every rank passes the same keys, in
            the same order; keys starting with ``phase/`` may differ between ranks. NaN or
            None marks a value this rank lacks; a value that is not a number warns once and
            counts as lacking.
        group: the process group to gather over.
        iteration: when given, must be the same on every rank.
        interval: this rank's ``tensorboard_log_interval``, when given: the iteration
            error then says when the ranks' intervals differ.
        timeout_s: how long to wait for the other ranks; None (the default) waits forever.

    Returns:
        A GatheredMemory: each rank's values, the per-key maximum and the rank holding it.

    Raises:
        MemoryReduceError: the ranks' keys or iterations differ (every rank raises alike,
            naming them), or some rank did not join within ``timeout_s`` or left.
    """
    return PROCESS.shared.gather(memory_report, group, iteration=iteration, interval=interval, timeout_s=timeout_s)


def single_rank(memory_report: dict) -> GatheredMemory:
    """The same lined-up view for a process alone in its group (no collective)."""
    return PROCESS.shared.single_rank(memory_report)


def reduction_group(
    group: dist.ProcessGroup | None, *, backend: str = "auto", world_scope: bool = False, timeout_s: float | None = None
) -> dist.ProcessGroup | None:
    """The group to gather memory over: ``group`` itself, or a gloo group of the same ranks.

    ``backend`` is LoggerConfig.memory_reduce_backend: "group" -> ``group``; "gloo" -> a gloo
    twin; "auto" -> a gloo twin for the pp scope when the job's default group runs on NCCL,
    else ``group`` (CPU jobs; and the world scope, where gloo's ring of world-size steps
    would cost more than the wait it saves: see docs/configuration.md).

    Creating groups is a collective over the whole world: call this on EVERY rank at once,
    with the same settings. A twin made here is kept (by the free functions' ``Reduction``)
    for as long as ``group`` lives, and returned again by later calls; a run makes and
    releases its own (``Reduction.group_for``, from MemoryMonitor.place). For the pp scope
    every rank learns every PP group's ranks from one small gather over the world
    (megatron-core keeps only this rank's), then every rank creates every twin, in the same
    order. That gather waits at most ``timeout_s`` (None: for ever), then raises
    MemoryReduceError.
    """
    return PROCESS.shared.group_for(group, backend=backend, world_scope=world_scope, timeout_s=timeout_s)


def twin_for(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The gloo twin an open ``Reduction`` (a placed run's, or the free functions') made for
    ``group``, or None. Asked in the order they were made, which is the same on every rank
    (every rank makes its runs in the same order), so every rank of the group finds the same
    twin. No collective."""
    for ref in list(PROCESS.open):
        reduction = ref()
        twin = None if reduction is None else reduction.twin_of(group)
        if twin is not None:
            return twin
    return None
