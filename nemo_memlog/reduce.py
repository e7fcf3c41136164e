"""The one place that talks to other ranks: gather every stage's memory report.

Steady state is ONE collective per call (``EXCHANGE``: an all-gather by default), of a
few int64 words per rank (see payload.py). From the gathered reports every rank derives
the same things: the per-key maximum, which rank holds it, and each rank's own values. The same
collective carries each rank's iteration and key-set fingerprint, so ranks that
disagree raise the same clear error together instead of mixing values up.

A key-set handshake (a 2-word gather) runs on the first call for a group, and again
only when some rank's key set changes. It exists because gloo, given tensors of
different lengths, returns wrong values without an error.

Every rank of a group enters the same collectives, of the same sizes, in the same order,
whatever keys each rank passes: whether to run the handshake is decided from words every
rank received alike (the agreed layout, and the fingerprints in the last gather), never
from one rank's own keys. Every wait is bounded, so a rank that does not join makes the
others raise MemoryReduceError instead of hanging.

State: a ``Reduction`` holds a channel per group (the agreed layout and its buffers) and the
gloo twins it made. A run (MemoryMonitor) owns one and closes it when it closes; the free
functions here share one of their own (see ``Reduction``).
"""

from __future__ import annotations

import datetime
import functools
import math
import time
import weakref

import numpy
import torch
import torch.distributed as dist

from . import payload
from .attribution import GatheredMemory, line_up
from .config import default_of
from .failure.identity import default_store
from .failure.records import PEER_LOSS
from .warn import WarnOnce

#: The steady-state collective; set it alike on every rank. "all_gather" (the default):
#: all_gather_single of each rank's words. "all_to_all": all_to_all_single of each rank's
#: words repeated once per rank, which delivers the same gathered words. gloo runs the
#: all-gather as a ring of N-1 dependent steps and the all-to-all as direct sends: on a
#: 2-core CPU box the reduction alone took a third to a half less time at PP 4-8
#: (docs/performance.md). Not the default until it is measured on NCCL.
EXCHANGE = "all_gather"


class MemoryReduceError(RuntimeError):
    """Ranks of the group disagree (keys, iteration) or one did not join in time."""


#: How long a helper call waits for the other ranks: LoggerConfig's memory_reduce_timeout_s default.
DEFAULT_TIMEOUT_S = default_of("memory_reduce_timeout_s")
#: A gloo wait that fails before this share of its timeout did not time out: a peer's socket
#: closed (gloo raises at once when a peer process ends), which reduce.py says as such.
PEER_LEFT_FRACTION = 0.9


def reduce_max_memory_across_pp_group(
    memory_report: dict, pp_group, *, timeout_s: float | None = DEFAULT_TIMEOUT_S
) -> dict:
    """Per-key MAX of ``memory_report`` across ``pp_group``, on every rank of the group.

    Megatron-Bridge's contract, kept: returns ``memory_report`` itself, with no
    collective, when it is empty, when torch.distributed is unavailable or not
    initialised, or when the group is None, has size 1, or has no callable ``size``.
    Never mutates its input. ints come back as ints (exact in the int64 range), floats
    as floats; a key every rank lacks is dropped. Runs on gloo (CPU tensor) and NCCL
    (current CUDA device) alike.

    Ranks that pass different keys all raise MemoryReduceError naming the keys. A rank
    that takes one of the no-op paths above while the others reduce leaves them waiting:
    they raise MemoryReduceError after ``timeout_s`` (None: wait forever).
    """
    if not takes_part(memory_report, pp_group):
        return memory_report
    # A MemoryMonitor placed in this job made a gloo twin of this group: same ranks, same
    # result, and no GPU work. Without one, the group itself (this helper creates no group:
    # that is a collective over the whole world, which its callers do not promise to enter).
    twin = twin_for(pp_group)
    return gather_memory(memory_report, pp_group if twin is None else twin, timeout_s=timeout_s).maximum


def takes_part(memory_report: dict, group) -> bool:
    """Whether a reduction over ``group`` would run a collective (same answer on every rank)."""
    if not memory_report or group is None:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return False
    size = getattr(group, "size", None)
    return callable(size) and size() > 1


def gather_memory(
    memory_report: dict,
    group,
    *,
    iteration: int | None = None,
    interval: int | None = None,
    timeout_s: float | None = None,
) -> GatheredMemory:
    """Gather every rank's report over ``group`` in one collective and line them up.

    ``iteration``, when given, must be the same on every rank, or every rank raises
    MemoryReduceError naming each rank's iteration; ``interval`` (this rank's
    tensorboard_log_interval, when given) lets that error say when the ranks' intervals
    differ rather than that a rank skipped a call. ``timeout_s`` bounds the wait for
    the other ranks; past it the ranks that joined raise MemoryReduceError.
    Call only when ``takes_part`` is true. The key-set handshake runs on the first call
    per group (the free functions' ``Reduction`` keeps each group's agreed layout).
    """
    return _shared.gather(memory_report, group, iteration=iteration, interval=interval, timeout_s=timeout_s)


def single_rank(memory_report: dict) -> GatheredMemory:
    """The same lined-up view for a process alone in its group (no collective)."""
    return _shared.single_rank(memory_report)


def reduction_group(group, *, backend: str = "auto", world_scope: bool = False, timeout_s: float | None = None):
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
    return _shared.group_for(group, backend=backend, world_scope=world_scope, timeout_s=timeout_s)


def twin_for(group):
    """The gloo twin an open ``Reduction`` (a placed run's, or the free functions') made for
    ``group``, or None. Asked in the order they were made, which is the same on every rank
    (every rank makes its runs in the same order), so every rank of the group finds the same
    twin. No collective."""
    for ref in list(_open):
        reduction = ref()
        twin = None if reduction is None else reduction.twin_of(group)
        if twin is not None:
            return twin
    return None


def _check_iterations(reports: list, iteration: int | None, interval: int | None, group) -> None:
    """Raise MemoryReduceError when the ranks sent different iterations (every rank sees the same
    words, so every rank raises). ``interval``: this rank's tensorboard_log_interval. A rank logs only
    at multiples of its own interval, so another rank's iteration that is no multiple of this rank's
    says their intervals differ; the error then says that, not that a call was skipped. (The header
    carries the iteration only, so a rank whose own interval divides every iteration seen cannot
    tell the two apart: its error names both causes.)"""
    if iteration is None:
        return
    seen = [report.iteration for report in reports]
    if len(set(seen)) == 1:
        return
    listing = ", ".join(f"rank {rank}: {it}" for rank, it in enumerate(seen))
    at = f"memory reduction over {_describe(group)}: ranks are at different iterations ({listing})."
    if not interval:
        raise MemoryReduceError(
            f"{at} Every rank must call training_log with the same iteration; one stage skipped or repeated a call."
        )
    off = [
        f"rank {rank}'s iteration {it}" for rank, it in enumerate(seen) if it != payload.NOT_CHECKED and it % interval
    ]
    if off:
        raise MemoryReduceError(
            f"{at} The ranks log at different tensorboard_log_interval: this rank logs every {interval} iterations, "
            f"and {', '.join(off)}: no multiple of {interval}. Every rank must use the same tensorboard_log_interval "
            f"(the same logger config), so that every rank logs at the same iterations."
        )
    raise MemoryReduceError(
        f"{at} Either a stage skipped or repeated a call (every rank must call training_log at every iteration), "
        f"or a rank's tensorboard_log_interval differs from this rank's ({interval}): every rank must use the "
        f"same tensorboard_log_interval (the same logger config)."
    )


def _agree_on_layout(channel, layout, group, iteration, timeout_s) -> None:
    """Handshake: a gather of (fingerprint, length of the key names). Identical everywhere
    -> every rank adopts the layout. Otherwise every rank gathers the names (sized by
    the longest, so the sizes agree too) and raises the same MemoryReduceError."""
    names = "\x1f".join(layout.keys).encode()
    mine = torch.tensor([layout.fingerprint, len(names)], dtype=torch.int64)
    gathered = channel.gather_small(mine, group, iteration, timeout_s)
    fingerprints, lengths = gathered[0::2], gathered[1::2]
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
    raise MemoryReduceError(_key_mismatch_message(key_lists, group))


#: Keys a rank may report while others do not: a memory phase (measure/phase.py) only some stages ran.
#: Ranks that differ only in these agree on the union, and a rank sends those it lacks as missing.
OPTIONAL_PREFIX = "phase/"


def optional_union(key_lists: list) -> tuple[str, ...] | None:
    """The agreed keys of ranks that differ in optional keys only: the common keys in their order,
    then every optional key, sorted (the same on every rank). None when other keys differ."""
    required = [[k for k in keys if not k.startswith(OPTIONAL_PREFIX)] for keys in key_lists]
    if any(keys != required[0] for keys in required):
        return None
    optional = sorted({k for keys in key_lists for k in keys if k.startswith(OPTIONAL_PREFIX)})
    return (*required[0], *optional)


@functools.lru_cache(maxsize=64)
def fits(mine: tuple[str, ...], agreed: tuple[str, ...]) -> bool:
    """Whether a rank reporting ``mine`` can send in the ``agreed`` layout: the same required keys in
    the same order, and its optional keys among the agreed ones."""
    required = tuple(k for k in mine if not k.startswith(OPTIONAL_PREFIX))
    return required == tuple(k for k in agreed if not k.startswith(OPTIONAL_PREFIX)) and set(mine) <= set(agreed)


def _key_mismatch_message(key_lists: list, group) -> str:
    union: list = []
    for keys in key_lists:
        union.extend(k for k in keys if k not in union)
    lines = []
    for rank, keys in enumerate(key_lists):
        lacking = [k for k in union if k not in keys]
        order = "" if lacking or keys == key_lists[0] else " (same keys, different order)"
        lines.append(f"  rank {rank}: {len(keys)} keys" + (f", lacks {lacking}" if lacking else "") + order)
    return (
        f"memory reduction over {_describe(group)}: ranks report different keys, so values cannot be "
        f"lined up.\n" + "\n".join(lines) + "\nGive every rank the same memory_keys (and the same "
        "report keys in the same order); use NaN for a statistic one rank lacks."
    )


#: Where each global rank publishes, in the default store, how many times ``close_writers()``
#: ended its runs (no collective: a store key each).
RUNS_ENDED_KEY = "nemo_memlog/runs_ended/{rank}"
_runs_ended = 0  # per process: close_writers() calls on this rank


def runs_ended() -> None:
    """This rank's runs were ended by ``close_writers()``: count it, and say so in the store."""
    global _runs_ended
    _runs_ended += 1
    store = default_store()
    if store is not None:
        store.set(RUNS_ENDED_KEY.format(rank=dist.get_rank()), str(_runs_ended))


def agree_on_restart(group, timeout_s: float) -> None:
    """Before a run that follows a ``close_writers()`` enters its first collective: wait (bounded
    by ``timeout_s``) until every rank of ``group`` has ended its runs as often as this one, so a
    call made on one rank only raises here, naming the ranks, instead of a collective of different
    shapes that gloo answers by aborting the process. Store reads only; nothing on a first run."""
    store = default_store()
    if not _runs_ended or store is None or group is None:
        return
    ranks = dist.get_process_group_ranks(group)
    deadline = time.monotonic() + timeout_s
    while True:
        behind = [rank for rank in ranks if _ended_on(store, rank) != _runs_ended]
        if not behind:
            return
        if time.monotonic() > deadline:
            raise MemoryReduceError(
                f"close_writers() has ended this rank's runs {_runs_ended} time(s), but global rank(s) {behind} "
                f"of its group have not after {timeout_s:g} s: it ends the runs on the rank that calls it, so "
                f"call it on every rank at the same point of the loop (or on none) before logging again"
            )
        time.sleep(0.01)


def _ended_on(store, rank: int) -> int:
    key = RUNS_ENDED_KEY.format(rank=rank)
    return int(store.get(key)) if store.check([key]) else 0


class Reduction:
    """The reduction state of one run: a ``Channel`` per group it gathers over (the agreed key
    layout and its buffers), the gloo twins it made, and the warnings about report values.

    A run (MemoryMonitor) makes one, with its own WarnOnce, and ``close``s it when it closes.
    The free functions of this module (``gather_memory``, ``single_rank``, ``reduction_group``)
    share one of their own, never closed, that warns once per process.

    Channels and twins are keyed weakly by group, so an entry goes with its group and neither
    grows without bound (a torch ProcessGroup can be weakly referenced; ``None`` and objects
    that cannot are held strongly, and are in practice one: ``None``, a rank with no pipeline
    group). Every rank of a group must make the same calls through the same Reduction, in the
    same order: what one rank's channel agreed, every rank's did.
    """

    def __init__(self, warn: WarnOnce | None = None):
        self.warn = WarnOnce() if warn is None else warn
        self._channels = _GroupMap()
        self._twins = _GroupMap()
        self._created: list = []  # the gloo groups this Reduction created, destroyed at close
        _open[:] = [ref for ref in _open if ref() is not None] + [weakref.ref(self)]

    def gather(
        self,
        memory_report: dict,
        group,
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
        _check_iterations(reports, iteration, interval, group)
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

    def channel(self, group) -> Channel:
        """The channel for ``group``, made at its first use."""
        channel = self._channels.get(group)
        if channel is None:
            channel = self._channels[group] = Channel(group)
        return channel

    def groups(self) -> list:
        """The groups this Reduction holds a channel for (none once closed)."""
        return self._channels.keys()

    def group_for(self, group, *, backend: str = "auto", world_scope: bool = False, timeout_s: float | None = None):
        """``reduction_group``, keeping the twin (made once per group) in this Reduction."""
        if backend == "group" or not (dist.is_available() and dist.is_initialized()):
            return group
        world = dist.group.WORLD
        if backend == "auto" and (world_scope or not on_cuda(world)):
            return group
        twin = self._twins.get(group, _NONE)
        if twin is _NONE:
            twin, created = _world_twin(timeout_s) if world_scope else _pp_twin(group, world, timeout_s)
            self._created.extend(created)
            self._twins[group] = twin
        return twin

    def twin_of(self, group):
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
        _open[:] = [ref for ref in _open if ref() not in (None, self)]


_NONE = object()  # "no entry", where None is a value (the twin of a rank with no group)


class _GroupMap:
    """group -> value, weakly keyed where the group allows it, else held (see Reduction)."""

    def __init__(self):
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


#: The open Reductions, oldest first, for ``twin_for``; weakly (a run dropped without closing drops out).
_open: list = []
#: The free functions' Reduction: per process, never closed; warns once per process.
_shared = Reduction()


class Channel:
    """One group's state in a Reduction: the agreed layout and pre-allocated buffers for the exchange."""

    def __init__(self, group):
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_cuda(group) else torch.device("cpu")
        self.ranks = group.size()
        self.layout = None

    def adopt(self, layout, group) -> None:
        self.layout = layout
        # One row per rank on both sides: an all-gather sends row 0, an all-to-all sends every
        # row (each a copy of row 0), and both receive rank r's words in row r.
        self.send_host = torch.zeros(self.ranks * layout.words, dtype=torch.int64)
        self.recv_host = torch.zeros(self.ranks * layout.words, dtype=torch.int64)
        on_cpu = self.device.type == "cpu"
        self.send = self.send_host if on_cpu else self.send_host.to(self.device)
        self.recv = self.recv_host if on_cpu else self.recv_host.to(self.device)
        self.send_row = self.send[: layout.words]
        # numpy views share memory with the host tensors: filling and reading them costs
        # microseconds, where tiny torch ops cost several each.
        self.send_rows = self.send_host.numpy().reshape(self.ranks, layout.words)
        self.send_words = self.send_rows[0]
        self.recv_words = self.recv_host.numpy()

    def exchange(self, layout, memory_report, group, iteration, timeout_s, warn_value) -> list:
        """The one collective: every rank's words in the agreed layout, unpacked. ``warn_value(key, why)``
        hears of a value sent as missing."""
        if layout is self.layout or layout.keys == self.layout.keys:
            payload.pack_into(self.send_words, layout, memory_report, iteration, warn_value)
        else:
            # This rank's key set changed: its header alone tells every rank to re-agree.
            words = numpy.frombuffer(payload.pack(layout, memory_report, iteration, warn_value), dtype=numpy.int64)
            self.send_words[:] = 0
            self.send_words[: payload.HEADER_WORDS] = words[: payload.HEADER_WORDS]
        to_all = EXCHANGE == "all_to_all"
        if to_all:
            self.send_rows[1:] = self.send_words
        if self.send is not self.send_host:
            self.send.copy_(self.send_host)
        if to_all:
            self._wait(all_to_all_single(self.recv, self.send, group), group, iteration, timeout_s)
        else:
            self._wait(all_gather_single(self.recv, self.send_row, group), group, iteration, timeout_s)
        if self.recv is not self.recv_host:
            self.recv_host.copy_(self.recv)
        return payload.unpack(self.layout, self.recv_words, self.ranks)

    def gather_small(self, mine, group, iteration, timeout_s) -> list[int]:
        """Every rank's ``mine`` (same size and dtype on every rank), concatenated, as a list."""
        out = torch.empty(mine.numel() * self.ranks, dtype=mine.dtype, device=self.device)
        self._wait(all_gather_single(out, mine.to(self.device), group), group, iteration, timeout_s)
        return out.tolist()

    def _wait(self, work, group, iteration, timeout_s) -> None:
        if timeout_s is None:
            work.wait()
        elif self.device.type == "cpu":
            started = time.monotonic()
            try:
                work.wait(timeout=_timedelta(timeout_s))
            except RuntimeError as error:
                waited = time.monotonic() - started
                if waited < PEER_LEFT_FRACTION * timeout_s or PEER_LOSS.search(str(error)):
                    raise _peer_left_error(group, iteration, timeout_s, waited, error) from error
                raise _timeout_error(group, iteration, timeout_s) from error
        else:
            # NCCL's wait() only orders streams; poll for completion to bound the wait.
            deadline = time.monotonic() + timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise _timeout_error(group, iteration, timeout_s)
                time.sleep(0.0005)


@functools.lru_cache(maxsize=8)
def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def all_gather_single(out, inp, group):
    """Start an all-gather of ``inp`` into ``out`` over ``group`` (async); the exchange's collective."""
    # torch >= 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


def all_to_all_single(out, inp, group):
    """Start an all-to-all of ``inp`` into ``out`` over ``group`` (async); the other exchange's collective."""
    return dist.all_to_all_single(out, inp, group=group, async_op=True)


def on_cuda(group) -> bool:
    """Whether a collective over ``group`` runs on CUDA tensors (NCCL without a gloo part)."""
    backend = str(dist.get_backend(group))
    return "gloo" not in backend and "nccl" in backend


def _world_twin(timeout_s) -> tuple:
    """(a gloo group of every rank, [it]): the world scope's twin, and what was created."""
    twin = _new_gloo_group(None, timeout_s)
    return twin, [twin]


def _pp_twin(group, world, timeout_s) -> tuple:
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
        return dist.new_group(ranks, backend="gloo", timeout=None if timeout_s is None else _timedelta(timeout_s))
    except Exception as error:  # gloo cannot connect (an interface it cannot reach, say)
        raise MemoryReduceError(
            f"creating a gloo group of ranks {ranks or 'all'} for the memory gather failed ({error}). "
            f"Set memory_reduce_backend='group' to gather over the group itself (on NCCL: on the GPU), "
            f"or point gloo at a reachable interface (GLOO_SOCKET_IFNAME)."
        ) from error


def _timeout_error(group, iteration, timeout_s) -> MemoryReduceError:
    at = "" if iteration is None else f" at iteration {iteration}"
    return MemoryReduceError(
        f"memory reduction over {_describe(group)}{at}: not every rank joined within "
        f"memory_reduce_timeout_s={timeout_s:g}s. A stage skipped this logging call, or took a "
        f"no-op path the others did not (an empty report, or a None group on that rank only), or logs at "
        f"another tensorboard_log_interval, or is stuck; every rank must call training_log (or the "
        f"reduction) at every iteration with the same config and a non-empty report."
    )


def _peer_left_error(group, iteration, timeout_s, waited, error) -> MemoryReduceError:
    """The collective failed early, or in a lost peer's words: a rank of the group is gone."""
    at = "" if iteration is None else f" at iteration {iteration}"
    said = str(error).strip().splitlines()[-1][:200] if str(error).strip() else type(error).__name__
    return MemoryReduceError(
        f"memory reduction over {_describe(group)}{at}: a peer left after {waited:.1f} s, before "
        f"memory_reduce_timeout_s={timeout_s:g}s ({said}). Its process ended (killed, crashed, or it left its "
        f"loop), or it never calls training_log: every rank must call training_log (or the reduction) at every "
        f"iteration with the same config; `nemo-memlog postmortem` on the run's memory_records names the rank."
    )


def _describe(group) -> str:
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # a group this rank is not in, or an exotic group object
        ranks = None
    return f"the group of global ranks {ranks}" if ranks else "the process group"
