"""Flight records of a simulated cluster, written by the recorder's own code (FlightRecorder).

Used by tests/test_postmortem.py and scripts/bench_postmortem.py. One process writes the files
of many ranks, each through a FlightRecorder built with the test parameters it takes: the
``identity`` of the rank it plays, a ``clock`` on the scenario's timeline, and
``liveness=False`` (the beat the thread would write is written with the recorder's own
``write_liveness``, at the time the scenario chooses). Records, OOM records and end markers go
through ``record``, ``record_oom`` and ``end`` as in training; a rank that "dies" is
``abandon()``-ed, with no end marker, as a SIGKILL leaves it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nemo_memlog.failure.recorder import FlightRecorder

GPUS_PER_NODE = 8


@dataclass
class Rank:
    """One simulated rank and what happens to it."""

    rank: int
    pp: int
    tp: int
    dp: int
    host: str
    world: int
    iterations: list[int] = field(default_factory=lambda: [10, 20, 30])
    peak_reserved_gb: float = 40.0
    stopped: float = 0.0  # unix time of its last beat, its OOM record and its end marker
    beats: bool = True  # False: no liveness beat written
    host_rss_gb: float = 20.0
    host_available_gb: float = 400.0
    vmstat_oom_kill: int | None = 0
    cgroup_oom_kill: int | None = None
    host_limit_gb: float | None = None  # the memory cgroup's limit and usage at the last beat
    host_limit_used_gb: float | None = None
    oom: dict | None = None  # fields of an OOM record (bytes_requested, ...)
    end: str | None = None  # end reason; None: killed without a trace
    end_detail: str = "simulated"  # the end record's detail (an exception's "Type: message")
    composition: dict | None = None  # what the memory is made of (measure/composition.py's keys), in every report

    def identity(self, run_id: str) -> dict:
        return {
            "run_id": run_id,
            "rank": self.rank,
            "world_size": self.world,
            "pp_rank": self.pp,
            "tp_rank": self.tp,
            "dp_rank": self.dp,
            "host": self.host,
        }

    def report(self, iteration: int) -> dict:
        """A GPU-like report_memory() + capacity_report(), growing a little with the iteration."""
        peak = self.peak_reserved_gb * (0.95 + 0.05 * iteration / max(self.iterations[-1], 1))
        return {
            "peak_allocated_gb": peak - 1.5,
            "peak_reserved_gb": peak,
            "peak_active_gb": peak - 1.5,
            "peak_inactive_gb": 1.2,
            "current_allocated_gb": peak - 6.0,
            "current_reserved_gb": peak - 0.5,
            "current_active_gb": peak - 6.0,
            "current_inactive_gb": 0.8,
            "alloc_retries": 0,
            "num_ooms": 0,
            "allocation_count": 123456 + iteration,
            "host_rss_gb": self.host_rss_gb,
            "peak_host_rss_gb": self.host_rss_gb + 0.5,
            "device_used_gb": peak + 1.1,
            "device_other_gb": 1.1,
            "device_total_gb": 80.0,
            "host_total_gb": 512.0,
            "host_available_gb": self.host_available_gb,
            **(self.composition or {}),
        }


#: The scenarios' time zero: an hour ago, so that no rank "may still be running".
T0 = time.time() - 3600.0


def closed_after(ranks: list[Rank], stopped: float, reason: str = "sigterm") -> list[Rank]:
    """The survivors: stopped by torchrun's SIGTERM ``stopped`` seconds after T0."""
    for rank in ranks:
        rank.stopped, rank.end = T0 + stopped, reason
    return ranks


def layout(pp: int, tp: int, dp: int, gpus_per_node: int = GPUS_PER_NODE) -> list[Rank]:
    """Megatron-Core's default order (tp fastest, then dp, then pp), ``gpus_per_node`` ranks a host."""
    world = pp * tp * dp
    hosts = -(-world // gpus_per_node)
    width = max(3, len(str(hosts - 1)))
    ranks = []
    for rank in range(world):
        ranks.append(
            Rank(
                rank,
                pp=rank // (tp * dp),
                tp=rank % tp,
                dp=rank // tp % dp,
                host=f"node-{rank // gpus_per_node:0{width}d}",
                world=world,
            )
        )
    return ranks


class _Clock:
    """A ``time.time`` for the recorder, on the scenario's timeline: it returns ``now``."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def write_run(directory, ranks: list[Rank], run_id: str = "sim-run", slots: int | None = None) -> None:
    """Every rank's file under ``directory``, through FlightRecorder."""
    for rank in ranks:
        write_rank(directory, rank, run_id, slots)


def write_rank(directory, rank: Rank, run_id: str = "sim-run", slots: int | None = None) -> str:
    """One rank's file: its step records 10 s apart up to ``stopped``, its last beat, then its
    OOM record and end marker at ``stopped``."""
    kwargs = {} if slots is None else {"slots": slots}
    clock = _Clock(rank.stopped - 10.0 * (len(rank.iterations) + 1))
    flight = FlightRecorder(directory, identity=rank.identity(run_id), clock=clock, liveness=False, **kwargs)
    assert flight.is_open, f"the recorder could not open {flight.path}"
    for iteration in rank.iterations:
        clock.now += 10.0
        flight.record(iteration, rank.report(iteration))
    clock.now = rank.stopped
    if rank.beats:
        flight.write_liveness(
            {
                "alive": rank.stopped,
                "beats": 100,
                "host_available_gb": rank.host_available_gb,
                "host_rss_gb": rank.host_rss_gb,
                "vmstat_oom_kill": rank.vmstat_oom_kill,
                "cgroup_oom_kill": rank.cgroup_oom_kill,
                "host_limit_gb": rank.host_limit_gb,
                "host_limit_used_gb": rank.host_limit_used_gb,
            }
        )
    if rank.oom is not None:
        flight.record_oom(rank.oom, rank.report(rank.iterations[-1]))
    if rank.end is not None:
        flight.end(rank.end, rank.end_detail)
    flight.abandon()  # no end marker of its own: as a SIGKILL leaves the file
    return flight.path
