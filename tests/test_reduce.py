"""reduce_max_memory_across_pp_group and gather_memory on real gloo process groups."""

import copy
import math
import warnings

import pytest
import torch

from nemo_memlog import payload
from nemo_memlog.reduce import MemoryReduceError, gather_memory, reduce_max_memory_across_pp_group
from nemo_memlog.testing.cluster import Cluster, RankFailure
from nemo_memlog.testing.collectives import GATHER, count_collectives
from nemo_memlog.testing.notices import said


def _coords():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return dist.get_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()


def _pp_group():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group()


def _report_for(rank, stage, dp):
    return {
        "peak_allocated_gb": 1.25 + stage + rank / 100,  # distinct per rank: exposes cross-group leaks
        "alloc_retries": 10 * (stage + 1) + dp,
        "huge_counter": 2**53 + 1 + rank,  # not representable as float64
        "negative": -5.0 - stage,
        "flag": stage == 0,  # a bool is not a counter
        "scalar_tensor": torch.tensor(7 + stage),
    }


def reduce_basic():
    rank, stage, dp = _coords()
    report = _report_for(rank, stage, dp)
    before = copy.deepcopy(report)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with count_collectives() as first_calls:
            reduce_max_memory_across_pp_group(report, _pp_group())
        with count_collectives() as calls:
            result = reduce_max_memory_across_pp_group(report, _pp_group())
    unchanged = all(
        (torch.equal(before[k], report[k]) if isinstance(report[k], torch.Tensor) else before[k] == report[k])
        for k in before
    )
    return {
        "coords": (rank, stage, dp),
        "result": result,
        "types": {k: type(v).__name__ for k, v in result.items()},
        "unchanged": unchanged and type(report["flag"]) is bool,
        "first_calls": first_calls,
        "calls": calls,
    }


def _expected_max(results, group_ranks):
    coords = [results[r]["coords"] for r in group_ranks]
    reports = [_report_for(*c) for c in coords]
    return {
        "peak_allocated_gb": max(r["peak_allocated_gb"] for r in reports),
        "alloc_retries": max(r["alloc_retries"] for r in reports),
        "huge_counter": max(r["huge_counter"] for r in reports),
        "negative": max(r["negative"] for r in reports),
        "flag": 1.0,
        "scalar_tensor": max(int(r["scalar_tensor"]) for r in reports),
    }


@pytest.mark.processes
@pytest.mark.parametrize("grid", ["pp2dp2", "pp4"])
def test_max_on_every_rank_of_each_pp_group(grid, request):
    cluster = request.getfixturevalue(grid)
    results = cluster.run_ok(reduce_basic)
    groups = [[0, 2], [1, 3]] if grid == "pp2dp2" else [[0, 1, 2, 3]]
    for group in groups:
        expected = _expected_max(results, group)
        for rank in group:
            got = results[rank]
            assert got["result"] == expected, f"rank {rank}"
            assert got["types"] == {
                "peak_allocated_gb": "float",
                "alloc_retries": "int",
                "huge_counter": "int",
                "negative": "float",
                "flag": "float",
                "scalar_tensor": "int",
            }
            assert got["result"]["huge_counter"] == 2**53 + 1 + max(group)  # exact beyond 2**53
            assert got["unchanged"], "the input report was mutated"
            assert got["calls"] == [GATHER], "steady state must be one collective"
            # handshake + data; on a group that agreed other keys before (the shared cluster
            # ran other tests first), one more: the exchange in which every rank sees the change
            assert got["first_calls"].count(GATHER) in (2, 3), got["first_calls"]


def reduce_with_missing():
    rank, stage, dp = _coords()
    report = {
        "only_stage0": 3.0 if stage == 0 else math.nan,
        "nobody": math.nan,
        "counter": 4 if stage == 1 else math.nan,
        "bad": "n/a" if stage == 0 else 2.5,
        "none_value": None if stage == 1 else 9,
        "matrix": torch.ones(2, 2) if stage == 0 else 1.5,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = reduce_max_memory_across_pp_group(report, _pp_group())
        reduce_max_memory_across_pp_group(report, _pp_group())  # warnings come once per key
    return stage, result, [str(w.message) for w in caught]


@pytest.mark.processes
def test_missing_and_bad_values_do_not_skip_the_collective(pp4):
    results = pp4.run_ok(reduce_with_missing)
    for stage, result, messages in results:
        assert result["only_stage0"] == 3.0
        assert "nobody" not in result, "a key every rank lacks is dropped after reduction"
        assert result["counter"] == 4 and type(result["counter"]) is int
        assert result["bad"] == 2.5 and result["none_value"] == 9 and result["matrix"] == 1.5
        if stage == 0:
            assert sum("'bad'" in m and "not a number" in m for m in messages) == 1
            assert sum("'matrix'" in m and "not a scalar" in m for m in messages) == 1
        if stage == 1:
            assert sum("'none_value'" in m for m in messages) == 1
        if stage >= 2:
            assert messages == []


def reduce_mismatched(kind):
    rank, stage, dp = _coords()
    report = {"a": 1.0, "b": 2.0}
    if kind == "extra" and stage == 1:
        report["extra_key"] = 5.0
    if kind == "order" and stage == 0:
        report = {"b": 2.0, "a": 1.0}
    reduce_max_memory_across_pp_group(report, _pp_group())


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["extra", "order"])
def test_mismatched_keys_raise_on_every_rank(pp2dp2, kind):
    results = pp2dp2.run(reduce_mismatched, kind)
    for rank, result in enumerate(results):
        assert isinstance(result, RankFailure), f"rank {rank} did not raise"
        assert result.type_name == "MemoryReduceError"
        assert "different keys" in result.message
        assert ("extra_key" in result.message) if kind == "extra" else ("different order" in result.message)
    # The group is still usable afterwards: a consistent call works.
    assert all(r["result"] for r in pp2dp2.run_ok(reduce_basic))


def reduce_changing_keys():
    out = []
    for keys in (("a", "b"), ("a", "b", "c", "d"), ("a",)):
        out.append(reduce_max_memory_across_pp_group({k: float(i) for i, k in enumerate(keys)}, _pp_group()))
    return out


@pytest.mark.processes
def test_key_set_changing_on_every_rank_is_agreed_again(pp4):
    for result in pp4.run_ok(reduce_changing_keys):
        assert result == [{"a": 0.0, "b": 1.0}, {"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0}, {"a": 0.0}]


def gather_at(iteration_by_stage):
    rank, stage, dp = _coords()
    return gather_memory({"x": 1.0}, _pp_group(), iteration=iteration_by_stage[stage])


@pytest.mark.processes
def test_iteration_disagreement_raises_on_every_rank(pp2dp2):
    results = pp2dp2.run(gather_at, {0: 10, 1: 11})
    for result in results:
        assert isinstance(result, RankFailure) and result.type_name == "MemoryReduceError"
        assert "rank 0: 10" in result.message and "rank 1: 11" in result.message


def gather_attribution():
    rank, stage, dp = _coords()
    gathered = gather_memory({"peak": 10.0 - stage, "count": stage}, _pp_group(), iteration=3)
    return gathered.keys, gathered.per_rank, gathered.maximum, gathered.peak_rank


@pytest.mark.processes
def test_gather_lines_up_every_stage(pp4):
    for keys, per_rank, maximum, peak_rank in pp4.run_ok(gather_attribution):
        assert keys == ("peak", "count")
        assert per_rank == [[10.0, 0], [9.0, 1], [8.0, 2], [7.0, 3]]
        assert maximum == {"peak": 10.0, "count": 3} and peak_rank == {"peak": 0, "count": 3}


def noop_paths():
    from megatron.core import parallel_state as ps

    report = {"x": 1.0}
    with count_collectives() as calls:
        same = [
            reduce_max_memory_across_pp_group(report, None) is report,
            reduce_max_memory_across_pp_group({}, _pp_group()) == {},
            reduce_max_memory_across_pp_group(report, ps.get_tensor_model_parallel_group()) is report,  # size 1
            reduce_max_memory_across_pp_group(report, object()) is report,  # no callable size
        ]
    return same, calls


@pytest.mark.processes
def test_noop_paths_issue_no_collective(pp2dp2):
    for same, calls in pp2dp2.run_ok(noop_paths):
        assert same == [True, True, True, True]
        assert calls == []


def test_noop_without_initialised_distributed():
    import torch.distributed as dist

    assert not dist.is_initialized()
    report = {"x": 1.0}
    assert reduce_max_memory_across_pp_group(report, object()) is report


def test_payload_round_trip_is_exact():
    report = {"f": 0.1, "i": -(2**62), "nan": math.nan, "inf": math.inf, "t": torch.tensor(2.5)}
    layout = payload.layout_of(tuple(report))
    packed = payload.pack(layout, report, 42, lambda key, why: None)
    (decoded,) = payload.unpack(layout, packed, 1)
    assert decoded.iteration == 42 and decoded.fingerprint == layout.fingerprint
    assert decoded.values == [0.1, -(2**62), None, math.inf, 2.5]
    assert [type(v) for v in decoded.values] == [float, int, type(None), float, float]


# --- issue 11: ranks whose keys change after the group agreed never break the collective ---

BASE = ("a", "b")
CHANGES = {"added": ("a", "b", "c"), "removed": ("a",), "reordered": ("b", "a")}


def _values(keys, stage, call):
    return {key: float(100 * call + 10 * stage + i) for i, key in enumerate(keys)}


def reduce_outcome(keys, stage, call):
    """("ok", result) or ("error", message) for one call; any other exception propagates."""
    try:
        with count_collectives() as calls:
            result = reduce_max_memory_across_pp_group(_values(keys, stage, call), _pp_group(), timeout_s=60)
        return "ok", result, calls
    except MemoryReduceError as error:
        return "error", str(error), None


def change_keys_in_steady_state(kind):
    """Steady state, then the key set changes on one stage, then another, then on all."""
    rank, stage, dp = _coords()
    changed = CHANGES[kind]
    plan = [
        BASE,
        BASE,  # agreed, then steady
        changed if stage == 1 else BASE,  # one stage
        BASE,  # back in agreement: the group still works
        changed if stage == 0 else BASE,  # another stage
        changed,  # all alike: re-agree and carry on
        changed,  # steady again
    ]
    return stage, [reduce_outcome(keys, stage, call) for call, keys in enumerate(plan)]


@pytest.mark.processes
@pytest.mark.parametrize("kind", sorted(CHANGES))
@pytest.mark.parametrize("grid", ["pp2dp2", "pp4"])
def test_key_set_changed_on_some_ranks_raises_everywhere_then_recovers(grid, kind, request):
    cluster = request.getfixturevalue(grid)
    stages = 2 if grid == "pp2dp2" else 4
    changed = CHANGES[kind]
    for stage, outcomes in cluster.run_ok(change_keys_in_steady_state, kind):
        status = [outcome[0] for outcome in outcomes]
        assert status == ["ok", "ok", "error", "ok", "error", "ok", "ok"], (stage, outcomes)
        for call in (2, 4):
            message = outcomes[call][1]
            assert "different keys" in message
            named = {"added": "lacks ['c']", "removed": "lacks ['b']", "reordered": "different order"}[kind]
            assert named in message, message
        for call, keys in ((0, BASE), (1, BASE), (3, BASE), (5, changed), (6, changed)):
            assert outcomes[call][1] == _values(keys, stages - 1, call), (stage, call)
        assert outcomes[1][2] == [GATHER] and outcomes[6][2] == [GATHER], "steady state is one collective"


CHOICES = (("a", "b"), ("a", "b", "c"), ("b", "a"), ("a",), ("c", "a", "b", "d"))


def reduce_random_key_sets(seed, calls):
    """Each call: every rank draws a key set; most calls a shared draw, some a rank's own."""
    import random

    rank, stage, dp = _coords()
    shared, own = random.Random(seed), random.Random(seed * 1000 + rank)
    drawn, outcomes = [], []
    for call in range(calls):
        common = shared.randrange(len(CHOICES))
        choice = common if shared.random() < 0.5 else own.randrange(len(CHOICES))
        drawn.append(choice)
        outcome = reduce_outcome(CHOICES[choice], stage, call)
        outcomes.append(outcome[:2])
    return (rank, stage), drawn, outcomes


@pytest.mark.processes
@pytest.mark.parametrize("grid", ["pp2dp2", "pp4"])
def test_random_key_sets_never_crash_and_agreeing_calls_are_right(grid, request):
    cluster = request.getfixturevalue(grid)
    results = cluster.run_ok(reduce_random_key_sets, 11, 50, timeout=240)
    groups = [[0, 2], [1, 3]] if grid == "pp2dp2" else [[0, 1, 2, 3]]
    agreed = disagreed = 0
    for group in groups:
        stages = [results[rank][0][1] for rank in group]
        for call in range(50):
            choices = {results[rank][1][call] for rank in group}
            for rank in group:
                status, value = results[rank][2][call]
                if len(choices) == 1:
                    keys = CHOICES[next(iter(choices))]
                    assert status == "ok", (rank, call, value)
                    assert value == _values(keys, max(stages), call), (rank, call)
                else:
                    assert status == "error" and "different keys" in value, (rank, call, value)
            agreed += len(choices) == 1
            disagreed += len(choices) > 1
    assert agreed >= 10 and disagreed >= 10, (agreed, disagreed)  # both paths really ran


def skip_on_one_rank(skip):
    """PP 2 x DP 2: in PP group {0, 2} rank 0 passes an empty report; in {1, 3} rank 1 a None group."""
    rank, stage, dp = _coords()
    group = _pp_group()
    reduce_max_memory_across_pp_group({"x": 1.0}, group, timeout_s=60)  # agreed and steady
    report = {} if (skip and rank == 0) else {"x": 2.0}
    if skip and rank == 1:
        group = None
    start = __import__("time").monotonic()
    try:
        if skip:
            return "returned", reduce_max_memory_across_pp_group(report, group, timeout_s=2.0), None
        return "returned", reduce_max_memory_across_pp_group(report, group), None
    except MemoryReduceError as error:
        return "raised", str(error), __import__("time").monotonic() - start


@pytest.mark.processes
def test_a_rank_that_takes_a_noop_path_alone_makes_the_others_raise_not_hang():
    from nemo_memlog import LoggerConfig

    assert reduce_max_memory_across_pp_group.__kwdefaults__["timeout_s"] == LoggerConfig().memory_reduce_timeout_s, (
        "the helper's default wait is memory_reduce_timeout_s's"
    )
    with Cluster(world=4, pp=2) as cluster:
        results = cluster.run_ok(skip_on_one_rank, True, timeout=60)
    assert results[0][:2] == ("returned", {}), "an empty report stays a no-op (Megatron-Bridge's contract)"
    assert results[1][:2] == ("returned", {"x": 2.0}), "a None group stays a no-op"
    for rank in (2, 3):
        status, message, waited = results[rank]
        assert status == "raised", (rank, message)
        assert "memory_reduce_timeout_s=2" in message and "empty report" in message
        assert 1.5 < waited < 30, waited


def log_with_exchange(exchange_by_stage):
    """One logging step of a run whose memory_reduce_exchange is this stage's (a setting)."""
    from nemo_memlog import LoggerConfig, MemoryMonitor
    from nemo_memlog.testing.collectives import count_collectives

    rank, stage, dp = _coords()
    config = LoggerConfig(
        log_memory_to_tensorboard=True, memory_reduce_exchange=exchange_by_stage[stage], memory_record_dir="off"
    )
    monitor = MemoryMonitor(config, pp_group=_pp_group())
    try:
        monitor.log(1, {"step_metric": 1.0})  # the handshake
        with count_collectives() as calls:
            unified = monitor.log(2, {"step_metric": 2.0})  # the steady state: the exchange itself
        return {"calls": calls, "peak_stage": unified.get("memory/peak_stage/peak_host_rss_gb")}
    finally:
        monitor.close()


@pytest.mark.processes
def test_the_exchange_is_a_setting_and_ranks_that_differ_raise_before_either_collective(pp4):
    """memory_reduce_exchange picks the steady-state collective, and the handshake agrees on it: ranks
    set differently all raise, naming the setting, instead of entering collectives that do not match."""
    for exchange, collective in (("all_gather", GATHER), ("all_to_all", "all_to_all_single")):
        for result in pp4.run_ok(log_with_exchange, {stage: exchange for stage in range(4)}):
            assert list(result["calls"]) == [collective] and result["peak_stage"] is not None, result
    mixed = {0: "all_gather", 1: "all_to_all", 2: "all_gather", 3: "all_gather"}
    for rank, result in enumerate(pp4.run(log_with_exchange, mixed)):
        assert isinstance(result, RankFailure) and result.type_name == "MemoryReduceError", (rank, result)
        assert "memory_reduce_exchange differ" in result.message and "'all_to_all' at position(s) [1]" in result.message
    assert all(r["result"] for r in pp4.run_ok(reduce_basic))  # the group is still usable afterwards


def _late_rank(root: str, late_rank: int, late_s: float) -> dict:
    import time

    import torch.distributed as dist

    import nemo_memlog

    cfg = nemo_memlog.LoggerConfig(
        log_memory_to_tensorboard=True,
        memory_record_dir=root,
        memory_reduce_stall_warn_s=1.0,
        memory_reduce_timeout_s=120.0,
        writer_mode="thread",
    )
    with said(warned=False) as seen:
        nemo_memlog.training_log(1, cfg)
        if dist.get_rank() == late_rank:
            time.sleep(late_s)  # this rank is late for step 2; its flight record still says step 1
        logged = nemo_memlog.training_log(2, cfg)
    nemo_memlog.close_writers()
    return {"logged": logged is not None, "warnings": [w for w in seen if "has waited" in w]}


@pytest.mark.processes
def test_a_long_wait_is_said_while_it_goes_on_naming_the_late_rank_then_completes(tmp_path):
    with Cluster(world=2, pp=2) as cluster:
        results = cluster.run_ok(_late_rank, str(tmp_path), 1, 4.0, timeout=120)
    arrived, late = results
    assert arrived["logged"] and late["logged"], "the wait went on to the end: both logged step 2"
    assert len(arrived["warnings"]) == 1, arrived["warnings"]
    said = arrived["warnings"][0]
    assert "iteration 2" in said and "rank 1 (last recorded step 1" in said, said
    assert "memory_reduce_timeout_s=120s" in said
    assert late["warnings"] == [], "the late rank never waited"
