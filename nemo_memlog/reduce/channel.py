"""A group's channel: the agreed layout, the pre-allocated buffers, the one collective of the
steady state (the exchange) and the small gathers of the handshake, every wait bounded.

A wait that outlasts its timeout raises MemoryReduceError saying that not every rank joined; a
gloo wait that fails well before it (a peer's socket closed) raises one saying a peer left.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy
import torch
import torch.distributed as dist

from .. import payload
from ..failure.records import PEER_LOSS
from .protocol import MemoryReduceError

#: The steady-state collective when a Reduction is given none; a run's must be the same on every
#: rank. "all_gather" (the default): all_gather_single of each rank's words. "all_to_all":
#: all_to_all_single of each rank's words repeated once per rank, which delivers the same gathered
#: words. gloo runs the all-gather as a ring of N-1 dependent steps and the all-to-all as direct
#: sends: on a 2-core CPU box the reduction alone took a third to a half less time at PP 4-8
#: (docs/performance.md). Not the default until it is measured on NCCL.
EXCHANGE = "all_gather"

#: A gloo wait that fails before this share of its timeout did not time out: a peer's socket
#: closed (gloo raises at once when a peer process ends), which the error says as such.
PEER_LEFT_FRACTION = 0.9


class Channel:
    """One group's state in a Reduction: the agreed layout and pre-allocated buffers for the exchange.

    ``exchange`` ("all_gather" or "all_to_all", see ``EXCHANGE``) is the steady-state collective;
    the handshake's small gathers are all-gathers either way."""

    def __init__(self, group: dist.ProcessGroup, exchange: str = EXCHANGE):
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_cuda(group) else torch.device("cpu")
        self.ranks = group.size()
        self.exchange_name = exchange
        self.to_all = exchange == "all_to_all"
        self.layout: Any = None  # the agreed payload.Layout, once every rank adopted it
        #: (after_s, alert(group, iteration, waited_s), StallWatch): a wait longer than after_s is
        #: said while it goes on (the Reduction sets it from the run's memory_reduce_stall_warn_s)
        self.stall: tuple | None = None

    def adopt(self, layout: payload.Layout, group: dist.ProcessGroup) -> None:
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

    def exchange(
        self,
        layout: payload.Layout,
        memory_report: dict,
        group: dist.ProcessGroup,
        iteration: int | None,
        timeout_s: float | None,
        warn_value: Callable[[str, str], None],
    ) -> list:
        """The one collective: every rank's words in the agreed layout, unpacked. ``warn_value(key, why)``
        hears of a value sent as missing."""
        if layout is self.layout or layout.keys == self.layout.keys:
            payload.pack_into(self.send_words, layout, memory_report, iteration, warn_value)
        else:
            # This rank's key set changed: its header alone tells every rank to re-agree.
            words = numpy.frombuffer(payload.pack(layout, memory_report, iteration, warn_value), dtype=numpy.int64)
            self.send_words[:] = 0
            self.send_words[: payload.HEADER_WORDS] = words[: payload.HEADER_WORDS]
        to_all = self.to_all
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

    def gather_small(
        self, mine: torch.Tensor, group: dist.ProcessGroup, iteration: int | None, timeout_s: float | None
    ) -> list[int]:
        """Every rank's ``mine`` (same size and dtype on every rank), concatenated, as a list."""
        out = torch.empty(mine.numel() * self.ranks, dtype=mine.dtype, device=self.device)
        self._wait(all_gather_single(out, mine.to(self.device), group), group, iteration, timeout_s)
        return out.tolist()

    def _wait(self, work, group, iteration, timeout_s) -> None:
        stall = self.stall
        watched = stall is not None and (timeout_s is None or stall[0] < timeout_s)
        if stall is not None and watched:
            after_s, alert, watch = stall
            watch.arm(after_s, functools.partial(alert, group, iteration))
        try:
            self._bounded_wait(work, group, iteration, timeout_s)
        finally:
            if watched:
                watch.disarm()

    def _bounded_wait(self, work, group, iteration, timeout_s) -> None:
        if timeout_s is None:
            work.wait()
        elif self.device.type == "cpu":
            started = time.monotonic()
            try:
                work.wait(timeout=timedelta_of(timeout_s))
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
def timedelta_of(seconds: float) -> datetime.timedelta:
    """``seconds`` as the timedelta torch.distributed takes (cached: a hot path builds it)."""
    return datetime.timedelta(seconds=seconds)


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """Start an all-gather of ``inp`` into ``out`` over ``group`` (async); the exchange's collective."""
    # torch >= 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """Start an all-to-all of ``inp`` into ``out`` over ``group`` (async); the other exchange's collective."""
    return dist.all_to_all_single(out, inp, group=group, async_op=True)


def on_cuda(group: dist.ProcessGroup | None) -> bool:
    """Whether a collective over ``group`` runs on CUDA tensors (NCCL without a gloo part)."""
    backend = str(dist.get_backend(group))
    return "gloo" not in backend and "nccl" in backend


def describe(group: dist.ProcessGroup | None) -> str:
    """The group, as an error names it: "the group of global ranks [...]"."""
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # a group this rank is not in, or an exotic group object
        ranks = None
    return f"the group of global ranks {ranks}" if ranks else "the process group"


def _timeout_error(group, iteration, timeout_s) -> MemoryReduceError:
    at = "" if iteration is None else f" at iteration {iteration}"
    return MemoryReduceError(
        f"memory reduction over {describe(group)}{at}: not every rank joined within "
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
        f"memory reduction over {describe(group)}{at}: a peer left after {waited:.1f} s, before "
        f"memory_reduce_timeout_s={timeout_s:g}s ({said}). Its process ended (killed, crashed, or it left its "
        f"loop), or it never calls training_log: every rank must call training_log (or the reduction) at every "
        f"iteration with the same config; `nemo-memlog postmortem` on the run's memory_records names the rank."
    )
