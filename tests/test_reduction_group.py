"""memory_reduce_backend: the memory gather over a gloo twin of the group, on real gloo clusters.

On these CPU clusters every group is already gloo, so "auto" keeps the group itself and
"gloo" makes the twin: the same creation path an NCCL job takes by default (tests/gpu runs
the NCCL side where there is a GPU).
"""

import contextlib
import warnings

import pytest

from nemo_memlog import LoggerConfig, training_log
from nemo_memlog.testing.cluster import Cluster, RankFailure
from nemo_memlog.testing.collectives import GATHER, count_collectives
from tests.rank_calls import skip_or_log


def log_twice(**config):
    """Two logging steps; the group the monitor gathered over, and what it logged."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_memlog.monitor.training_log import monitor_of

    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_per_stage_keys=["peak_host_rss_gb"], **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no writer configured
        training_log(1, cfg)
        with count_collectives() as calls:
            logged = training_log(2, cfg)
    group = monitor_of(cfg).group
    pp_group = ps.get_pipeline_model_parallel_group()
    target = dist.group.WORLD if config.get("memory_reduce_scope") == "world" else pp_group
    return {
        "rank": dist.get_rank(),
        "backend": str(dist.get_backend(group)),
        "ranks": dist.get_process_group_ranks(group),
        "target_ranks": dist.get_process_group_ranks(target),
        "is_target": group is target,
        "calls": calls,
        "stages": sorted(k for k in logged if k.startswith("memory/pp_stage_")),
        "peak_stage": logged.get("memory/peak_stage/peak_host_rss_gb"),
    }


@pytest.mark.processes
@pytest.mark.parametrize("scope", ["pp", "world"])
def test_gloo_twin_has_the_groups_ranks_and_carries_the_one_gather(pp2dp2, scope):
    results = pp2dp2.run_ok(log_twice, memory_reduce_backend="gloo", memory_reduce_scope=scope)
    for result in results:
        assert not result["is_target"] and result["backend"] == "gloo", "a group of its own"
        assert result["ranks"] == result["target_ranks"], "the same ranks, in the same order"
        assert result["calls"] == [GATHER], "steady state: still one collective"
    if scope == "pp":  # PP groups {0, 2} and {1, 3}: two stages each, lined up by stage
        assert all(
            r["stages"] == ["memory/pp_stage_0/peak_host_rss_gb", "memory/pp_stage_1/peak_host_rss_gb"] for r in results
        )


@pytest.mark.processes
def test_auto_on_a_gloo_job_gathers_over_the_group_itself(pp2dp2):
    for result in pp2dp2.run_ok(log_twice, memory_reduce_backend="auto"):
        assert result["is_target"] and result["calls"] == [GATHER]


class Discard:
    """Writers that keep nothing."""

    def log(self, metrics, step):
        pass

    def flush(self):
        pass


@contextlib.contextmanager
def groups_gathered_over():
    """The group of every all-gather issued meanwhile (a pass-through spy: each call runs for real)."""
    import torch.distributed as dist

    seen, names = [], [name for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)]
    originals = {name: getattr(dist, name) for name in names}

    def spy(original):
        def gather(*args, **kwargs):
            seen.append(kwargs.get("group"))
            return original(*args, **kwargs)

        return gather

    for name, original in originals.items():
        setattr(dist, name, spy(original))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def helper_after_placement():
    """Megatron-Bridge's helper, given the NCCL-style PP group, after a monitor made its twin;
    then again after the monitor closed."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_memlog import close_writers, reduce_max_memory_across_pp_group
    from nemo_memlog.monitor import MemoryMonitor

    close_writers()  # the runs earlier tests left open in this process (their twins would serve as well)
    pp_group = ps.get_pipeline_model_parallel_group()
    monitor = MemoryMonitor(
        LoggerConfig(
            log_memory_to_tensorboard=True,
            memory_reduce_backend="gloo",
            memory_reduce_timeout_s=60,
            memory_record_dir="off",
        ),
        writers=Discard(),
    )
    monitor.place()
    twin = monitor.group
    with groups_gathered_over() as used:
        reduced = reduce_max_memory_across_pp_group({"x": dist.get_rank(), "y": 0.5}, pp_group)
    monitor.close()
    with groups_gathered_over() as after_close:
        reduce_max_memory_across_pp_group({"x": dist.get_rank(), "y": 0.5}, pp_group)
    return (
        reduced,
        twin is not pp_group and twin in used,
        pp_group in used,
        bool(after_close) and all(group is pp_group for group in after_close),
    )


@pytest.mark.processes
def test_bridge_helper_keeps_its_contract_and_rides_the_twin(pp2dp2):
    results = pp2dp2.run_ok(helper_after_placement)
    for rank, (reduced, twin_used, group_used, group_after_close) in enumerate(results):
        assert reduced == {"x": 2 + rank % 2, "y": 0.5} and type(reduced["x"]) is int  # max over {0,2} / {1,3}
        assert twin_used and not group_used, "the gather ran over the gloo twin, not the group it was given"
        assert group_after_close, "the run closed, its twin went with it: the group itself"


def channels_across_close():
    """A run's channels and gloo twin, before and after it closes."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_memlog.monitor import MemoryMonitor
    from nemo_memlog.reduce import twin_for

    pp_group = ps.get_pipeline_model_parallel_group()
    monitor = MemoryMonitor(
        LoggerConfig(log_memory_to_tensorboard=True, memory_reduce_backend="gloo", memory_record_dir="off"),
        writers=Discard(),
    )
    monitor.log_step(1)
    reduction, twin = monitor.reduction, monitor.group
    before = {
        "channels": reduction.groups() == [twin],
        "found": twin_for(pp_group) is twin,
        "backend": str(dist.get_backend(twin)),
    }
    monitor.close()
    try:
        dist.get_backend(twin)
        destroyed = False
    except ValueError:  # torch: "Invalid process group specified"
        destroyed = True
    after = {
        "channels": reduction.groups(),
        "found": twin_for(pp_group),
        "destroyed": destroyed,
        "group": monitor.group,
    }
    return before, after


@pytest.mark.processes
def test_a_closed_run_releases_its_channels_and_destroys_its_twin(pp2dp2):
    for before, after in pp2dp2.run_ok(channels_across_close):
        assert before == {"channels": True, "found": True, "backend": "gloo"}
        assert after == {"channels": [], "found": None, "destroyed": True, "group": None}


@pytest.mark.processes
def test_a_rank_that_never_places_makes_the_others_raise_not_hang():
    with Cluster(world=2, pp=2) as cluster:
        # skip_or_log: every rank but 1 logs its first step, so places itself (and gathers the groups)
        results = cluster.run(skip_or_log, 1, 2.0, memory_reduce_backend="gloo", timeout=60)
    assert results[1] == "skipped"
    failure = results[0]
    assert isinstance(failure, RankFailure) and failure.type_name == "MemoryReduceError"
    assert "memory_reduce_timeout_s=2" in failure.message


def test_bad_backend_is_named():
    with pytest.raises(ValueError, match="memory_reduce_backend must be one of 'auto', 'gloo', 'group'"):
        LoggerConfig(memory_reduce_backend="nccl")
