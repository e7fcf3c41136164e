"""memory_reduce_backend: the memory gather over a gloo twin of the group, on real gloo clusters.

On these CPU clusters every group is already gloo, so "auto" keeps the group itself and
"gloo" makes the twin: the same creation path an NCCL job takes by default (tests/gpu runs
the NCCL side where there is a GPU).
"""

import warnings

import pytest

from nemo_memlog import LoggerConfig, training_log
from nemo_memlog.testing.cluster import Cluster, RankFailure
from nemo_memlog.testing.collectives import GATHER, count_collectives
from tests.test_hook import skip_or_log


def log_twice(**config):
    """Two logging steps; the group the monitor gathered over, and what it logged."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_memlog import hook

    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_per_stage_keys=["peak_host_rss_gb"], **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no writer configured
        training_log(1, cfg)
        with count_collectives() as calls:
            logged = training_log(2, cfg)
    group = hook._monitors[id(cfg)].group
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


@pytest.mark.parametrize("scope", ["pp", "world"])
def test_gloo_twin_has_the_groups_ranks_and_carries_the_one_gather(pp2dp2, scope):
    results = pp2dp2.run_ok(log_twice, memory_reduce_backend="gloo", memory_reduce_scope=scope)
    for result in results:
        assert not result["is_target"] and result["backend"] == "gloo", "a group of its own"
        assert result["ranks"] == result["target_ranks"], "the same ranks, in the same order"
        assert result["calls"] == [GATHER], "steady state: still one collective"
    if scope == "pp":  # PP groups {0, 2} and {1, 3}: two stages each, lined up by stage
        assert all(r["stages"] == ["memory/pp_stage_0/peak_host_rss_gb", "memory/pp_stage_1/peak_host_rss_gb"]
                   for r in results)


def test_auto_on_a_gloo_job_gathers_over_the_group_itself(pp2dp2):
    for result in pp2dp2.run_ok(log_twice, memory_reduce_backend="auto"):
        assert result["is_target"] and result["calls"] == [GATHER]


def helper_after_placement():
    """Megatron-Bridge's helper, given the NCCL-style PP group, after a monitor made its twin."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_memlog import reduce, reduce_max_memory_across_pp_group

    pp_group = ps.get_pipeline_model_parallel_group()
    twin = reduce.reduction_group(pp_group, backend="gloo", timeout_s=60)
    before = set(reduce._channels)
    reduced = reduce_max_memory_across_pp_group({"x": dist.get_rank(), "y": 0.5}, pp_group)
    used = set(reduce._channels) - before
    return reduced, twin in reduce._channels, pp_group in used


def test_bridge_helper_keeps_its_contract_and_rides_the_twin(pp2dp2):
    for rank, (reduced, twin_used, group_used) in enumerate(pp2dp2.run_ok(helper_after_placement)):
        assert reduced == {"x": 2 + rank % 2, "y": 0.5} and type(reduced["x"]) is int  # max over {0,2} / {1,3}
        assert twin_used and not group_used, "the gather ran over the gloo twin, not the group it was given"


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
