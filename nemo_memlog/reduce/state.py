"""The reduction state of a run (``Reduction``: its channels and gloo twins), the key-set
handshake it runs through a channel, and the one registry of what belongs to the process
(``PROCESS``: the open Reductions, the free functions' Reduction, close_writers' count).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import payload
from ..attribution import GatheredMemory, line_up
from ..warn import WarnOnce
from .channel import EXCHANGE, Channel, describe, on_cuda
from .protocol import (
    EXCHANGES,
    MemoryReduceError,
    check_iterations,
    exchange_mismatch_message,
    fits,
    key_mismatch_message,
    optional_union,
)
from .stall import StallWatch
from .twins import pp_twin, world_twin


class Reduction:
    """The reduction state of one run: a ``Channel`` per group it gathers over (the agreed key
    layout and its buffers), the gloo twins it made, and the warnings about report values.

    A monitor (MemoryMonitor) makes one, with its own WarnOnce, and ``close``s it when it closes.
    The free functions (helpers.py: ``gather_memory``, ``single_rank``, ``reduction_group``)
    share one of their own (``PROCESS.shared``), never closed, that warns once per process.

    ``exchange`` is the steady-state collective of its channels ("all_gather" or "all_to_all",
    see channel.EXCHANGE); it must be the same on every rank of a group.

    Channels and twins are keyed weakly by group, so an entry goes with its group and neither
    grows without bound (a torch ProcessGroup can be weakly referenced; ``None`` and objects
    that cannot are held strongly, and are in practice one: ``None``, a rank with no pipeline
    group). Every rank of a group must make the same calls through the same Reduction, in the
    same order: what one rank's channel agreed, every rank's did.
    """

    def __init__(self, warn: WarnOnce | None = None, exchange: str = EXCHANGE):
        self.warn = WarnOnce() if warn is None else warn
        self.exchange = exchange
        #: (after_s, alert(group, iteration, waited_s)): say a wait longer than after_s while it goes on
        self.stall: tuple[float, Callable] | None = None
        self._channels = _GroupMap()
        self._twins = _GroupMap()
        self._created: list = []  # the gloo groups this Reduction created, destroyed at close
        PROCESS.open[:] = [ref for ref in PROCESS.open if ref() is not None] + [weakref.ref(self)]

    def gather(
        self,
        memory_report: dict,
        group: dist.ProcessGroup,
        *,
        iteration: int | None = None,
        interval: int | None = None,
        timeout_s: float | None = None,
    ) -> GatheredMemory:
        """``gather_memory`` through this Reduction's channel for ``group``."""
        layout = payload.layout_of(tuple(memory_report))
        channel = self.channel(group)
        # channel.layout changes only when every rank adopts a layout together, so this
        # test, unlike "are my keys the agreed ones?", has the same answer on every rank.
        if channel.layout is None:
            _agree_on_layout(channel, layout, group, iteration, timeout_s)
        while True:
            if layout is not channel.layout and fits(layout.keys, channel.layout.keys):
                # Optional keys (a phase other ranks ran) agreed on: send this rank's lacking ones as missing.
                memory_report = {key: memory_report.get(key, math.nan) for key in channel.layout.keys}
                layout = channel.layout
            # Always the agreed size: a rank whose keys changed sends just its header.
            reports = channel.exchange(layout, memory_report, group, iteration, timeout_s, self.warn_value)
            fingerprint = channel.layout.fingerprint
            if all(report.fingerprint == fingerprint for report in reports):
                break
            # Some rank's key set differs from the agreed one: every rank sees that in the
            # same gathered words, so every rank re-runs the handshake together.
            _agree_on_layout(channel, layout, group, iteration, timeout_s)
        check_iterations(reports, iteration, interval, group, describe)
        return line_up(channel.layout.keys, reports)

    def single_rank(self, memory_report: dict) -> GatheredMemory:
        """``single_rank``, warning through this Reduction."""
        values = []
        for key, value in memory_report.items():
            value, kind, problem = payload.scalar(value)
            if problem is not None:
                self.warn_value(key, problem)
            values.append(None if kind is None else value)
        return line_up(tuple(memory_report), [payload.RankReport(len(values), 0, payload.NOT_CHECKED, values)])

    def gather_ints(self, group: dist.ProcessGroup | None, mine: tuple[int, ...], timeout_s: float | None) -> list:
        """Every position's ``mine`` (a few ints, the same count on every rank), in one small
        gather over ``group``: a tuple per position. No collective for no group or a group of one.
        A run calls it once, when it is placed (the world scope's coordinates of every rank)."""
        if group is None or group.size() <= 1 or not (dist.is_available() and dist.is_initialized()):
            return [tuple(mine)]
        words = self.channel(group).gather_small(torch.tensor(mine, dtype=torch.int64), group, None, timeout_s)
        count = len(mine)
        return [tuple(words[at : at + count]) for at in range(0, len(words), count)]

    def channel(self, group: dist.ProcessGroup) -> Channel:
        """The channel for ``group``, made at its first use."""
        channel = self._channels.get(group)
        if channel is None:
            channel = self._channels[group] = Channel(group, self.exchange)
        channel.stall = None if self.stall is None else (*self.stall, PROCESS.stall_watch)
        return channel

    def groups(self) -> list:
        """The groups this Reduction holds a channel for (none once closed)."""
        return self._channels.keys()

    def group_for(
        self,
        group: dist.ProcessGroup | None,
        *,
        backend: str = "auto",
        world_scope: bool = False,
        timeout_s: float | None = None,
    ) -> dist.ProcessGroup | None:
        """``reduction_group``, keeping the twin (made once per group) in this Reduction."""
        if backend == "group" or not (dist.is_available() and dist.is_initialized()):
            return group
        world = dist.group.WORLD
        if world is None:  # initialised means a world group: for the type checker
            return group
        if backend == "auto" and (world_scope or not on_cuda(world)):
            return group
        twin = self._twins.get(group, _NONE)
        if twin is _NONE:
            twin, created = world_twin(timeout_s) if world_scope else pp_twin(group, world, timeout_s)
            self._created.extend(created)
            self._twins[group] = twin
        return twin

    def twin_of(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The twin this Reduction made for ``group``, or None."""
        return self._twins.get(group)

    def warn_value(self, key: str, why: str) -> None:
        """Warn once that ``key``'s value cannot be sent as a number (``payload``'s callback)."""
        self.warn(
            ("value", key, why),
            f"memory report value for {key!r}: {why}; this rank reports it as missing",
            category=UserWarning,
            stacklevel=4,
        )

    def close(self) -> None:
        """Drop every channel and twin, and destroy the gloo groups this Reduction created.

        Destroying a group is local in torch.distributed (no collective): each rank destroys
        its own handle when its run closes. A rank still gathering over the twin then sees
        the others gone, and raises MemoryReduceError as for a rank that stopped logging.
        Never raises."""
        self._channels.clear()
        self._twins.clear()
        created, self._created = self._created, []
        for group in created:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group(group)
            except Exception:  # already gone (the world was destroyed first): nothing to release
                pass
        PROCESS.open[:] = [ref for ref in PROCESS.open if ref() not in (None, self)]


def _agree_on_layout(channel, layout, group, iteration, timeout_s) -> None:
    """Handshake: a gather of (fingerprint, length of the key names, the exchange). Every rank
    raises alike when the ranks' exchanges (memory_reduce_exchange) differ. Identical fingerprints
    everywhere -> every rank adopts the layout. Otherwise every rank gathers the names (sized by
    the longest, so the sizes agree too) and raises the same MemoryReduceError."""
    names = "\x1f".join(layout.keys).encode()
    exchange = EXCHANGES.index(channel.exchange_name)
    mine = torch.tensor([layout.fingerprint, len(names), exchange], dtype=torch.int64)
    gathered = channel.gather_small(mine, group, iteration, timeout_s)
    fingerprints, lengths, exchanges = gathered[0::3], gathered[1::3], gathered[2::3]
    if any(other != exchange for other in exchanges):  # before any exchange of a shape the others do not run
        raise MemoryReduceError(exchange_mismatch_message([EXCHANGES[e] for e in exchanges], describe(group)))
    if all(f == layout.fingerprint for f in fingerprints):
        channel.adopt(layout, group)
        return
    # Rare path, taken by every rank together: name the keys that differ.
    width = max(lengths)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: len(names)] = torch.tensor(list(names), dtype=torch.uint8)
    everyone = channel.gather_small(padded, group, iteration, timeout_s)
    key_lists = [
        bytes(everyone[r * width : r * width + n]).decode().split("\x1f") if n else [] for r, n in enumerate(lengths)
    ]
    union = optional_union(key_lists)
    if union is not None:  # they differ in optional keys only: every rank adopts the union
        channel.adopt(payload.layout_of(union), group)
        return
    raise MemoryReduceError(key_mismatch_message(key_lists, describe(group)))


_NONE = object()  # "no entry", where None is a value (the twin of a rank with no group)


class _GroupMap:
    """group -> value, weakly keyed where the group allows it, else held (see Reduction)."""

    def __init__(self) -> None:
        self._weak: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._held: dict = {}

    def get(self, group, default=None):
        try:
            return self._weak.get(group, default)
        except TypeError:  # cannot be weakly referenced (None)
            return self._held.get(group, default)

    def __setitem__(self, group, value) -> None:
        try:
            self._weak[group] = value
        except TypeError:
            self._held[group] = value

    def keys(self) -> list:
        return list(self._weak.keys()) + list(self._held)

    def clear(self) -> None:
        self._weak.clear()
        self._held.clear()


class ProcessReductions:
    """What the reductions of this process share (see ``PROCESS``): no run can own any of it."""

    #: The free functions' Reduction: never closed; warns once per process. Made right after
    #: ``PROCESS``, at import, so it is the oldest open Reduction (``twin_for`` asks it first).
    shared: Reduction

    def __init__(self) -> None:
        #: The open Reductions, oldest first, for ``twin_for``; weakly (a run dropped without
        #: closing drops out). Each Reduction adds itself when made and leaves when closed.
        self.open: list = []
        #: close_writers() calls on this rank (restart.py publishes it for ``agree_on_restart``).
        self.runs_ended = 0
        #: The one thread that says a collective's wait is long (stall.py), for every Reduction.
        self.stall_watch = StallWatch()


# Per process, not per run: the free helper functions (gather_memory, single_rank,
# reduction_group, twin_for) have no run to hold their Reduction or the list of open ones that
# twin_for searches, and close_writers() ends every run of the process, so its count outlives them.
PROCESS = ProcessReductions()
PROCESS.shared = Reduction()
