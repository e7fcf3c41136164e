"""training_log on real gloo clusters: the gate, the reduction, attribution, the merge."""

import warnings

import pytest

from nemo_memlog import LoggerConfig, training_log
from nemo_memlog.testing.cluster import Cluster, RankFailure
from nemo_memlog.testing.collectives import GATHER, count_collectives
from nemo_memlog.testing.notices import said
from tests.rank_calls import skip_or_log

BIG_MB = 300
_ballast = []


def _coords():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return dist.get_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()


def hold_ballast(global_ranks):
    """The chosen ranks touch BIG_MB of host memory and keep it: a real RSS difference."""
    import torch

    rank, _, _ = _coords()
    if rank in global_ranks and not _ballast:
        _ballast.append(torch.ones(BIG_MB * 2**20 // 8, dtype=torch.float64))
    return rank


def release_ballast():
    _ballast.clear()


def log_iterations(iterations, **config):
    cfg = LoggerConfig(log_memory_to_tensorboard=True, **config)
    out = []
    with said() as caught:
        for iteration in iterations:
            with count_collectives() as calls:
                result = training_log(iteration, cfg, metrics={"loss": 2.0 + iteration, "lr": 0.1})
            out.append((iteration, result, list(calls)))
    return _coords(), out, [w for w in caught]


@pytest.fixture
def stage2_holds_most(pp4):
    pp4.run_ok(hold_ballast, {2})
    yield
    pp4.run_ok(release_ballast)


@pytest.mark.processes
def test_pipeline_max_and_attribution_on_every_rank(pp4, stage2_holds_most):
    results = pp4.run_ok(log_iterations, [1, 2, 3, 4], tensorboard_log_interval=2)
    unified = {}
    for (rank, _stage, _), steps, messages in results:
        by_iter = {it: (res, calls) for it, res, calls in steps}
        assert by_iter[1] == (None, []) and by_iter[3] == (None, []), "off-interval steps do nothing"
        logged, calls = by_iter[4]
        assert calls == [GATHER], "a logging step in steady state is one collective"
        unified[rank] = logged
        assert logged["loss"] == 6.0 and logged["lr"] == 0.1, "the caller's metrics ride in the same dict"
        per_stage = [logged[f"memory/pp_stage_{s}/peak_host_rss_gb"] for s in range(4)]
        assert logged["memory/peak_host_rss_gb"] == max(per_stage)
        assert logged["memory/peak_stage/peak_host_rss_gb"] == 2
        assert type(logged["memory/peak_stage/peak_host_rss_gb"]) is int
        assert per_stage[2] - min(per_stage) > 0.8 * BIG_MB * 2**20 / 1e9, "the ballast shows in stage 2's RSS"
        assert logged["memory/host_headroom_gb"] > 0 and 0 < logged["memory/peak_host_rss_pct"] < 100
        assert not any(k.startswith("memory/pp_stage_") and "current" in k for k in logged)  # peak_* only
        no_writer = [m for m in messages if "no writer is configured" in m]
        assert len(no_writer) == (1 if rank == 3 else 0), "only the writer rank builds writers"
    assert all(unified[r] == unified[0] for r in unified), "every rank returns the same unified dict"


def log_with(container_kind):
    from megatron.core import parallel_state as ps

    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=5)

    class Container:  # Megatron-Bridge's ConfigContainer shape: the logger fields under .logger
        logger = cfg

    class Collection:  # ProcessGroupCollection shape: .pp
        pp = ps.get_pipeline_model_parallel_group()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if container_kind == "container":
            return training_log(10, Container())
        if container_kind == "pg_collection":
            return training_log(10, cfg, pg_collection=Collection())
        return training_log(10, cfg, pp_group=ps.get_pipeline_model_parallel_group())


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["container", "pg_collection", "pp_group"])
def test_config_and_group_sources(pp2dp2, kind):
    results = pp2dp2.run_ok(log_with, kind)
    for _rank, logged in enumerate(results):
        stages = sorted(k for k in logged if k.startswith("memory/pp_stage_") and k.endswith("peak_host_rss_gb"))
        assert stages == ["memory/pp_stage_0/peak_host_rss_gb", "memory/pp_stage_1/peak_host_rss_gb"]
    # PP groups {0,2} and {1,3} reduce separately: each group's dicts agree with each other.
    assert results[0]["memory/peak_host_rss_gb"] == results[2]["memory/peak_host_rss_gb"]
    assert results[1]["memory/peak_host_rss_gb"] == results[3]["memory/peak_host_rss_gb"]


@pytest.mark.processes
def test_megatron_process_group_collection(pp2dp2):
    results = pp2dp2.run_ok(log_with_megatron_collection)
    for logged in results:
        assert "memory/pp_stage_1/peak_host_rss_gb" in logged


def log_with_megatron_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    cfg = LoggerConfig(log_memory_to_tensorboard=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return training_log(1, cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


@pytest.mark.processes
def test_world_scope_names_rank_stage_and_dp(pp2dp2):
    pp2dp2.run_ok(hold_ballast, {2})
    try:
        results = pp2dp2.run_ok(log_iterations, [3], memory_reduce_scope="world", tensorboard_log_interval=3)
    finally:
        pp2dp2.run_ok(release_ballast)
    _, stage, dp = results[2][0]  # where megatron placed global rank 2
    assert (stage, dp) == (1, 0)  # megatron's default order tp-cp-ep-dp-pp
    for _, steps, _ in results:
        logged = steps[0][1]
        assert logged["memory/peak_rank/peak_host_rss_gb"] == 2
        assert logged["memory/peak_stage/peak_host_rss_gb"] == stage
        assert logged["memory/peak_dp_rank/peak_host_rss_gb"] == dp
        assert logged["memory/peak_tp_rank/peak_host_rss_gb"] == 0
        assert logged[f"memory/pp_stage_{stage}/peak_host_rss_gb"] == logged["memory/peak_host_rss_gb"]
        assert logged[f"memory/pp_stage_{1 - stage}/peak_host_rss_gb"] < logged["memory/peak_host_rss_gb"]
        assert "memory/host_headroom_rank" in logged


def test_gate_rejects_bad_interval():
    with pytest.raises(ValueError, match="tensorboard_log_interval must be an int >= 1"):
        LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=0)

    class BridgeLike:  # a foreign config object is checked when first used
        log_memory_to_tensorboard = True
        tensorboard_log_interval = 0

    with pytest.raises(ValueError, match="tensorboard_log_interval"):
        training_log(5, BridgeLike())


def test_disabled_logging_returns_none_without_work():
    cfg = LoggerConfig(log_memory_to_tensorboard=False, tensorboard_dir="/nonexistent/never/created")
    assert training_log(10, cfg, metrics={"loss": 1.0}) is None


@pytest.mark.processes
def test_a_rank_that_skips_a_logging_call_times_out_cleanly():
    with Cluster(world=2, pp=2) as cluster:
        cluster.run_ok(log_with, "pp_group")  # first call: the handshake has happened
        results = cluster.run(skip_or_log, 1, 2.0, timeout=60)
    assert results[1] == "skipped"
    failure = results[0]
    assert isinstance(failure, RankFailure) and failure.type_name == "MemoryReduceError"
    assert "iteration 7" in failure.message and "[0, 1]" in failure.message
    assert "memory_reduce_timeout_s=2" in failure.message


def test_caller_metrics_bad_input_is_named_and_numbers_are_kept():
    import torch

    cfg = LoggerConfig(log_memory_to_tensorboard=True)
    metrics = {
        "loss": float("nan"),
        "grad_norm": float("inf"),
        "skipped": True,
        "tokens": 2**60 + 1,
        "lr": torch.tensor(0.5),
        "note": "warmup",
        "nothing": None,
        "vec": torch.ones(3),
    }
    with said(notices=False) as caught:
        logged = training_log(1, cfg, metrics=metrics)
    assert logged["loss"] != logged["loss"] and logged["grad_norm"] == float("inf")  # NaN/inf kept
    assert logged["skipped"] == 1.0 and logged["tokens"] == 2**60 + 1 and logged["lr"] == 0.5
    assert not {"note", "nothing", "vec"} & logged.keys()
    text = " | ".join(w for w in caught)
    for name in ("'note'", "'nothing'", "'vec'", "'skipped'"):
        assert name in text, f"{name} must be named in a warning"


@pytest.mark.processes
def test_low_headroom_warning_names_the_stage_on_the_writer_rank_only(pp4):
    # Asking for 99.9% free makes any real machine "low": the warning path runs for real.
    results = pp4.run_ok(log_iterations, [1, 2], memory_headroom_warn_fraction=0.999)
    for (rank, _, _), steps, messages in results:
        stage = steps[0][1]["memory/host_headroom_stage"]  # where it was lowest when first warned
        warned = [m for m in messages if "close to the OOM killer" in m]
        if rank == 3:
            assert len(warned) == 1, "once, not every step"
            assert f"pipeline stage {stage}'s node" in warned[0]
        else:
            assert warned == []


@pytest.mark.parametrize(
    "config, hint",
    [
        (None, "got NoneType"),
        ({"log_memory_to_tensorboard": True}, "A plain dict is not read: pass nemo_memlog.LoggerConfig(**your_dict)"),
        ("logger.log_memory_to_tensorboard=true", "got str"),
    ],
)
def test_a_config_it_cannot_read_raises_instead_of_logging_nothing(config, hint):
    # Read with every default, these logged nothing, silently (flag off).
    with pytest.raises(TypeError, match="expected a config with log_memory_to_tensorboard") as error:
        training_log(1, config)
    assert hint in str(error.value)


def test_the_flag_off_stays_a_silent_no_op():
    class BridgeLogger:  # any object with the flag, as Megatron-Bridge's LoggerConfig
        log_memory_to_tensorboard = False

    class Container:
        logger = BridgeLogger()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for config in (LoggerConfig(), BridgeLogger(), Container()):
            assert all(training_log(iteration, config) is None for iteration in range(1, 4))


@pytest.mark.processes
def test_a_config_rebuilt_at_every_call_with_equal_settings_reuses_one_run(tmp_path):
    from nemo_memlog import close_writers
    from nemo_memlog.monitor.training_log import monitor_of, open_monitors

    close_writers()  # the runs earlier tests left open in this process

    def rebuilt():
        return LoggerConfig(
            log_memory_to_tensorboard=True, tensorboard_dir=str(tmp_path / "tb"), memory_record_dir="off"
        )

    fanouts = []
    for iteration in range(1, 5):
        assert training_log(iteration, rebuilt(), metrics={"loss": 1.0 * iteration})["loss"] == iteration
        fanouts.append(monitor_of(rebuilt()).writers)
    assert len(open_monitors()) == 1, "equal settings: one run"
    assert fanouts[0] is not None and all(fanout is fanouts[0] for fanout in fanouts), "one writer fan-out"
    close_writers()
    assert open_monitors() == () and monitor_of(rebuilt()) is None


def test_settings_that_change_at_every_call_make_new_runs_and_warn_once():
    from nemo_memlog import close_writers
    from nemo_memlog.monitor.training_log import MANY_RUNS, open_monitors

    close_writers()
    with said(notices=False) as caught:
        for interval in range(2, 2 * MANY_RUNS + 2):  # iteration 1: off-interval, nothing logged
            assert (
                training_log(1, LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=interval)) is None
            )
    made = open_monitors()
    close_writers()
    assert len(made) == 2 * MANY_RUNS and len({id(monitor) for monitor in made}) == len(made), "a run for each settings"
    warned = [w for w in caught if "runs in this process" in w]
    assert len(warned) == 1 and "Build the config once" in warned[0], [w for w in caught]


# --- the door: the protocol every way in drives (MemoryMonitor.open, log, close) -------------------


class KeptSteps:
    """Writers as the monitor takes them (``log(metrics, step)``, ``flush``, ``close``): the steps handed over."""

    def __init__(self):
        self.steps: list[int] = []

    def log(self, metrics, step):
        self.steps.append(step)

    def flush(self):
        pass

    def close(self):
        pass


def test_a_frameworks_run_logs_each_step_once_with_its_facts_checked_and_redacted():
    from nemo_memlog import MemoryMonitor
    from nemo_memlog.redaction import REDACTED

    config = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=2, memory_record_dir="off")
    kept = KeptSteps()
    monitor = MemoryMonitor.open(config, writers=lambda: kept, facts={"micro_batch_size": 4, "wandb_api_key": "k-1"})
    assert monitor.facts == {"micro_batch_size": 4, "wandb_api_key": REDACTED}  # as training_log's facts= are
    with said() as caught:
        assert monitor.log(1) is None  # the gate: off the interval
        assert monitor.log(2, {"loss": 1.0})["loss"] == 1.0
        assert monitor.log(2, {"loss": 2.0}) is None  # a second way in, or one installed twice: ignored
        assert monitor.log(4, step=3) is not None  # gated at 4, recorded at 3 (Lightning's numbering)
        assert monitor.log(4, step=3) is None
    assert kept.steps == [2, 3]
    assert [text for text in caught if "was logged already" in text] == [
        "nemo_memlog: step 2 was logged already; a second log of it is ignored"
    ], "said once, for the first repeat"
    monitor.close()
    assert monitor.log(4, step=3) is not None and kept.steps == [2, 3, 3], "closed: the next log is a new run's"
    monitor.close()
    with pytest.raises(ValueError, match=r"facts\['micro_batch_size'\] must be a positive int"):
        MemoryMonitor.open(config, facts={"micro_batch_size": 0})  # one check for every way in


def test_training_log_takes_the_callers_iterations_as_given_a_repeat_logs_again():
    config = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=7)
    with said():  # no writer configured: said, not raised
        first = training_log(7, config, metrics={"loss": 1.0})
        again = training_log(7, config, metrics={"loss": 2.0})
    assert first["loss"] == 1.0 and again["loss"] == 2.0
