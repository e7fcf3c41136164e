"""MemoryLogCallback inside the installed Megatron-Bridge's real training pieces, on CPU gloo
ranks. ``make test`` runs this file against Bridge 0.6.2 (.venv), and its tests marked ``versions``
(those whose expectations read the installed version, ``BRIDGE``, or run Bridge code that changed
between releases) again against 0.3.1 (.venv-bridge03).

nemo_memlog/testing/bridge_harness.py drives Bridge's loop (real GlobalState, ConfigContainer, loggers,
CallbackManager, training_log) with PP 2 (world 2) and PP 2 x DP 2 (world 4); stage 0
holds a ballast, so the pipeline's host peak is on the first stage while Bridge logs from
the last rank. Then the last rank's stores are read back raw (tests/bridge_readback.py):
TensorBoard events, the W&B offline run, the MLflow SQLite store. 6 iterations,
tensorboard_log_interval=2, log_interval=1: Bridge logs its metrics (and the callback
memory) at steps 2, 4, 6, and its iteration-time (log_timers_to_tensorboard) at every step.

Last, the callback on megatron-core's own GPTModel in Megatron's DDP, each iteration Bridge's own
train_step (the harness's ``megatron`` mode, PP 2 x DP 2): its per-layer records on every rank, and
``advise`` from them held against a rerun with the change.
"""

import contextlib
import dataclasses
import os
import statistics

import numpy as np
import pytest

from nemo_memlog.offline import events, report
from nemo_memlog.testing.bridge_env import bridge_version
from nemo_memlog.testing.bridge_harness import RunSpec, end_runs, exit_early_then_train_again, train
from nemo_memlog.testing.bridge_probes import (
    bench_off_interval,
    bridge_logger_names,
    bridge_mlflow_names,
    callback_mlflow_names,
)
from nemo_memlog.testing.cluster import Cluster
from nemo_memlog.testing.collectives import GATHER
from nemo_memlog.testing.megatron import cpu as megatron_cpu
from tests.bridge_readback import mlflow_experiments, mlflow_runs, tensorboard_events, wandb_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

CALLBACK = {"memory_reduce_scope": "pp", "memory_per_stage_keys": ["peak_*"], "memory_reduce_timeout_s": 60}
LOGGING_STEPS = [2, 4, 6]
ALL_STEPS = [1, 2, 3, 4, 5, 6]
BALLAST_MB = 600
#: How far stage 0's peak must stand above the last stage's: the ballast, less what the
#: last rank alone carries (Bridge's loggers, W&B's and MLflow's clients: about 0.1-0.2 GB).
CLEAR_GB = 0.25
RUN_TIMEOUT_S = 240  # a loaded 2-core machine: imports, W&B's service, MLflow's first open

#: Every memory series the callback must write on this CPU machine (host memory only).
REQUIRED_MEMORY = [
    "memory/host_rss_gb",
    "memory/peak_host_rss_gb",
    "memory/peak_stage/peak_host_rss_gb",
    "memory/pp_stage_0/peak_host_rss_gb",
    "memory/pp_stage_1/peak_host_rss_gb",
    "memory/host_headroom_gb",
    "memory/host_headroom_stage",
    "memory/peak_host_rss_pct",
]
BRIDGE = bridge_version()
#: From 0.5 Bridge max-reduces its own memory report over the PP group (before: the last stage's).
BRIDGE_PP_MAX = BRIDGE >= (0, 5)
#: Bridge's own series at its logging steps, per backend (with our LoggerConfig).
BRIDGE_TB = ["learning-rate", "batch-size", "lm loss", "loss-scale", "grad-norm"]
BRIDGE_TB_VS_SAMPLES = [f"{tag} vs samples" for tag in BRIDGE_TB]
BRIDGE_WANDB_MLFLOW = ["learning-rate", "batch-size", "lm loss", "loss-scale", "grad-norm", "samples vs steps"]
#: Bridge's series at every log_interval step (a timing: checked for presence, not value).
BRIDGE_EVERY_STEP = "iteration-time"


class Recorded:
    """One harness run's spec and records: every rank's record, with the ranks that matter."""

    def __init__(self, spec, records):
        self.spec, self.records = spec, records
        self.writer = records[-1]  # Bridge's loggers live on the last rank
        (self.first_stage,) = [r for r in records if r.pp_stage == 0 and r.dp_rank == self.writer.dp_rank]

    def at(self, record, step):
        (found,) = [s for s in record.steps if s.step == step]
        return found

    def bridge_values(self, step):
        """What the loop handed Bridge's training_log for the iteration logged at ``step``."""
        s = self.at(self.writer, step)
        # Bridge max-reduces the learning rate over the model-parallel group as a float32 tensor.
        return {
            "learning-rate": f32(s.learning_rate),
            "batch-size": s.batch_size,
            "lm loss": s.loss,
            "loss-scale": 1.0,
            "grad-norm": s.grad_norm,
            "samples vs steps": s.consumed_train_samples,
        }


def _run(cluster, root, **spec_fields):
    spec = RunSpec(root=str(root), ballast_mb=BALLAST_MB, **spec_fields)
    return Recorded(spec, cluster.run_ok(train, spec, timeout=RUN_TIMEOUT_S))


@pytest.fixture(scope="module")
def pp2():
    with Cluster(world=2, pp=2) as cluster:
        yield cluster
        end_cluster(cluster)


@pytest.fixture(scope="module")
def pp2dp2_bridge():
    """Its own PP 2 x DP 2 cluster: these ranks import Bridge and hold a ballast."""
    with Cluster(world=4, pp=2) as cluster:
        yield cluster
        end_cluster(cluster)


@pytest.fixture(scope="module")
def bridge_alone(pp2, tmp_path_factory):
    return _run(pp2, tmp_path_factory.mktemp("bridge_alone"))


@pytest.fixture(scope="module", params=["pp2", "pp2dp2"])
def with_callback(request, tmp_path_factory):
    cluster = request.getfixturevalue("pp2" if request.param == "pp2" else "pp2dp2_bridge")
    return _run(cluster, tmp_path_factory.mktemp(f"callback_{request.param}"), callback_kwargs=CALLBACK)


@pytest.fixture(scope="module")
def flag_off(pp2, tmp_path_factory):
    return _run(pp2, tmp_path_factory.mktemp("flag_off"), callback_kwargs=CALLBACK, log_memory_to_tensorboard=False)


def end_cluster(cluster):
    """Before the module's cluster closes: see end_runs (a rank lost to a failed test: no wait)."""
    with contextlib.suppress(TimeoutError):
        cluster.run(end_runs, timeout=60)


def f32(value):
    """A value as TensorBoard stores it (float32)."""
    return float(np.float32(value))


def memory_names(names):
    return sorted(n for n in names if n.startswith("memory"))


def bridge_memory_names(names):
    """Bridge's own memory series (its MEMORY_KEYS names: memory/mem-..., MLflow memory_mem-...)."""
    return [n for n in names if n.startswith(("memory/mem-", "memory_mem-"))]


def check_required_memory(names, spell=lambda name: name):
    missing = [spell(n) for n in REQUIRED_MEMORY if spell(n) not in names]
    assert not missing, f"memory series missing: {missing}"
    assert not bridge_memory_names(names), "Bridge's own last-stage memory series must be off"
    assert spell("memory/pp_stage_2/peak_host_rss_gb") not in names, "PP 2 has stages 0 and 1"


def check_bridge_metrics(run, tb, history, mlflow_metrics):
    """Bridge's own series: at each of its logging steps, once, with the values it was given."""
    for tag in BRIDGE_TB:
        expected = [(s, f32(run.bridge_values(s)[tag])) for s in LOGGING_STEPS]
        assert tb[tag] == expected, tag
    for tag, base in zip(BRIDGE_TB_VS_SAMPLES, BRIDGE_TB):
        expected = [
            (run.at(run.writer, s).consumed_train_samples, f32(run.bridge_values(s)[base])) for s in LOGGING_STEPS
        ]
        assert tb[tag] == expected, tag
    assert [s for s, _ in tb[BRIDGE_EVERY_STEP]] == ALL_STEPS
    assert sorted(history) == ALL_STEPS, "one W&B row per step Bridge logs at"
    for step in ALL_STEPS:
        assert BRIDGE_EVERY_STEP in history[step], step
        for key in BRIDGE_WANDB_MLFLOW:
            if step in LOGGING_STEPS:
                assert history[step][key] == pytest.approx(run.bridge_values(step)[key], rel=1e-12), (step, key)
            else:
                assert key not in history[step], (step, key)
    for key in BRIDGE_WANDB_MLFLOW:
        expected = [(s, pytest.approx(run.bridge_values(s)[key], rel=1e-12)) for s in LOGGING_STEPS]
        assert mlflow_metrics[key] == expected, key
    assert [s for s, _ in mlflow_metrics[BRIDGE_EVERY_STEP]] == ALL_STEPS


# --- the baseline: Bridge alone, proving the harness and showing the problem -----------------


@pytest.mark.versions
def test_bridge_alone_logs_its_own_memory_into_all_three_backends(bridge_alone, pp2):
    run = bridge_alone
    files, tb = tensorboard_events(run.spec.root)
    assert len(files) == 1
    logs, history, _ = wandb_run(run.spec.root)
    assert len(logs) == 1
    (mlflow_run,) = mlflow_runs(run.spec.mlflow_uri, "memlog-bridge")
    check_bridge_metrics(run, tb, history, mlflow_run["metrics"])
    # Bridge's memory series (its names), at its steps: before 0.5 the last stage's own
    # peak, from 0.5 the PP max (stage 0's, here), unattributed.
    peak = "memory/mem-max-allocated-gigabytes"
    assert [s for s, _ in tb[peak]] == LOGGING_STEPS
    for step, value in tb[peak]:
        last, first = run.at(run.writer, step), run.at(run.first_stage, step)
        reported, other = (first, last) if BRIDGE_PP_MAX else (last, first)
        # Bridge rounds to 5 significant digits, and reads a little after the harness did.
        assert value == pytest.approx(reported.peak_after, rel=1e-3), (
            f"Bridge {BRIDGE} reports stage {reported.pp_stage}"
        )
        assert abs(other.peak_after - value) > CLEAR_GB, "the stages differ by the ballast"
        assert history[step][peak] == pytest.approx(value, rel=1e-6)
    # In MLflow under the name its own sanitiser gives (the callback's names are checked against it).
    (spelled,) = set(bridge_mlflow_names_on(pp2, [peak]).values())
    assert spelled == (
        "memory/mem-max-allocated-gigabytes" if BRIDGE >= (0, 4) else "memory_mem-max-allocated-gigabytes"
    )
    assert [s for s, _ in mlflow_run["metrics"][spelled]] == LOGGING_STEPS
    # ... and nothing pipeline-wide exists without the callback.
    assert not any("pp_stage" in name or "peak_stage" in name for name in tb)


def bridge_mlflow_names_on(cluster, keys):
    """{key: its MLflow name} from the installed Bridge's own sanitiser, on the last rank."""
    return cluster.run_ok(bridge_mlflow_names, sorted(keys))[-1]


#: Names that tell Bridge's MLflow spellings apart (0.4+: the first '/' kept, '@' -> '_at_', ':' kept).
SPELLING_KEYS = [
    "memory/peak_reserved_gb",
    "memory/pp_stage_0/peak_host_rss_gb",
    "memory//a///b",
    "x@y/z@w",
    "memory/rank:3",
    "memory/weird key*(1)",
    "plain-name",
    "memory/mem-max-allocated-gigabytes",
]


@pytest.mark.versions
def test_callback_spells_mlflow_names_as_bridge_with_or_without_its_sanitiser(pp2):
    expected = bridge_mlflow_names_on(pp2, SPELLING_KEYS)
    spelled = pp2.run_ok(callback_mlflow_names, SPELLING_KEYS)[-1]
    assert spelled["importable"] == expected, "Bridge's own sanitiser"
    assert spelled["rule"] == expected, f"the rule for Bridge {BRIDGE}, where its sanitiser cannot be imported"
    assert (expected["memory/pp_stage_0/peak_host_rss_gb"] == "memory/pp_stage_0_peak_host_rss_gb") == (
        BRIDGE >= (0, 4)
    )


@pytest.mark.versions
def test_bridge_opens_comet_from_0_4(pp2):
    names = pp2.run_ok(bridge_logger_names)[-1]
    assert {"tensorboard_logger", "wandb_logger", "mlflow_logger"} <= set(names)
    assert ("comet_logger" in names) == (BRIDGE >= (0, 4)), names
    # The callback adopts whatever these return; a Comet experiment: tests/writers/test_adopt.py.


# --- the callback: TensorBoard --------------------------------------------------------------------


def test_tensorboard_one_writer_each_memory_series_once_per_step_with_the_first_stage_peak(with_callback):
    run = with_callback
    files, tb = tensorboard_events(run.spec.root)
    assert len(files) == 1, f"one events file (Bridge's writer), no second writer or directory: {files}"
    memory = memory_names(tb)
    check_required_memory(memory)
    for name in memory:
        assert [s for s, _ in tb[name]] == LOGGING_STEPS, f"{name}: once per Bridge logging step"
    for record in run.records:  # the flag on: nothing said (no flag notice, no stop)
        assert not [text for text in record.notices if "log_memory_to_tensorboard" in text or "stopped" in text]
    for step, value in tb["memory/peak_host_rss_gb"]:
        first, last = run.at(run.first_stage, step), run.at(run.writer, step)
        # The peak is the value stage 0 read inside on_train_step_end: VmHWM only grows.
        assert f32(first.peak_before) <= value <= f32(first.peak_after), (step, value, first)
        assert dict(tb["memory/pp_stage_0/peak_host_rss_gb"])[step] == value
        stage1 = dict(tb["memory/pp_stage_1/peak_host_rss_gb"])[step]
        assert f32(last.peak_before) <= stage1 <= f32(last.peak_after)
        assert value - stage1 > CLEAR_GB, "the first stage's ballast shows"
        assert dict(tb["memory/peak_stage/peak_host_rss_gb"])[step] == 0


def test_flight_records_beside_the_recipes_logs_ended_at_on_train_end(with_callback):
    """The callback's default record folder is ``memory_records`` beside the recipe's
    tensorboard_dir; every rank recorded the logging steps, under one run id, and on_train_end
    ended each record cleanly: the post-mortem finds no failure."""
    from tests.readback import postmortem

    run = with_callback
    folder = os.path.join(run.spec.root, "memory_records")
    assert os.path.dirname(run.spec.tensorboard_dir) == os.path.dirname(folder) and os.path.isdir(folder)
    status, found = postmortem(folder)
    assert status == 0 and found["first_failure"] is None and not found["ignored_runs"], found
    assert [(r["status"], r["end_reason"], r["last_iteration"]) for r in found["ranks"]] == [
        ("closed", "close", LOGGING_STEPS[-1])
    ] * len(found["ranks"]), found
    assert len(found["ranks"]) == found["world_size"] >= 2


@pytest.mark.versions
def test_activations_measured_between_step_start_and_step_end_on_every_stage(with_callback):
    """The harness's step runs one microbatch through ``model[0]``, a Linear(8, 8) on a (4, 8) float32
    input, which autograd saves (128 bytes; its weight is a parameter, not counted): on every stage,
    every logging step, measured between on_train_step_start and on_train_step_end."""
    from nemo_memlog.measure import layer_record

    run = with_callback
    _, tb = tensorboard_events(run.spec.root)
    assert tb["memory/activations_gb"] == [(step, f32(4 * 8 * 4 / 1e9)) for step in LOGGING_STEPS]
    assert tb["memory/microbatches_in_flight"] == [(step, 1) for step in LOGGING_STEPS]
    records = layer_record.read_folder(os.path.join(run.spec.root, "memory_records"))  # every rank's own
    assert len(records) >= 2 and all(r["iteration"] == LOGGING_STEPS[-1] for r in records)
    assert {r["pp_rank"] for r in records} == {0, 1}
    assert all(r["run"]["framework"] == "megatron-bridge" and r["run"]["microbatches"] >= 1 for r in records)
    assert all(r["stage"]["activations_per_microbatch_gb"] == 128 / 1e9 for r in records)
    # selective recompute's share, by Bridge 0.6's formula for the harness's model (hidden 8, ffn 32,
    # 2 heads, seq 16): (18 + 4 * 4) / (18 + 4 * 4 + 5 * 2 * 16 / 8) = 34 / 54; none before 0.6
    shares = {r["run"].get("selective_recompute_ratio") for r in records}
    assert shares == ({34 / 54} if bridge_version() >= (0, 6) else {None}), shares


def test_tensorboard_bridge_series_unchanged(with_callback, bridge_alone):
    run = with_callback
    files, tb = tensorboard_events(run.spec.root)
    _, history, _ = wandb_run(run.spec.root)
    (mlflow_run,) = mlflow_runs(run.spec.mlflow_uri, "memlog-bridge")
    check_bridge_metrics(run, tb, history, mlflow_run["metrics"])
    # The run config is recorded in Bridge's own TensorBoard run: report names the peak window.
    assert report.peak_window_line(events.load_run(files[0].parent)).startswith("peak window: run (")
    _, alone = tensorboard_events(bridge_alone.spec.root)
    bridge_tags = sorted(t for t in alone if not t.startswith("memory"))
    assert sorted(t for t in tb if not t.startswith("memory")) == bridge_tags, "no Bridge series lost or added"
    for tag in bridge_tags:
        assert [s for s, _ in tb[tag]] == [s for s, _ in alone[tag]], tag


# --- the callback: W&B ------------------------------------------------------------------------------


def test_wandb_one_run_memory_and_bridge_metrics_in_the_same_rows(with_callback, bridge_alone):
    run = with_callback
    logs, history, config = wandb_run(run.spec.root)
    assert len(logs) == 1, f"one W&B run (Bridge's): {logs}"
    _, tb = tensorboard_events(run.spec.root)
    _, alone, _ = wandb_run(bridge_alone.spec.root)
    assert sorted(history) == sorted(alone) == ALL_STEPS
    for step in ALL_STEPS:
        row = history[step]
        bridge_keys = sorted(k for k in alone[step] if not k.startswith(("memory", "_")))
        missing = [k for k in bridge_keys if k not in row]
        assert not missing, f"step {step}: Bridge's metrics lost from the row (the commit trap): {missing}"
        if step not in LOGGING_STEPS:
            assert memory_names(row) == [], f"step {step}: memory only at logging steps"
            continue
        check_required_memory(row)
        assert memory_names(row) == memory_names(tb), f"step {step}: every memory series in Bridge's row"
        first = run.at(run.first_stage, step)
        assert first.peak_before <= row["memory/peak_host_rss_gb"] <= first.peak_after
        assert row["memory/peak_stage/peak_host_rss_gb"] == 0
    assert config["logger"]["log_memory_to_tensorboard"] is True, "the recorded config shows the user's setting"


# --- the callback: MLflow -----------------------------------------------------------------------------


@pytest.mark.versions
def test_mlflow_one_run_bridge_spelling_first_stage_peak_and_recorded_flag(with_callback, bridge_alone, pp2):
    run = with_callback
    assert mlflow_experiments(run.spec.mlflow_uri) == ["Default", "memlog-bridge"]
    runs = mlflow_runs(run.spec.mlflow_uri, "memlog-bridge")
    assert len(runs) == 1, f"one MLflow run (Bridge's), got {len(runs)}"
    metrics, params = runs[0]["metrics"], runs[0]["params"]
    _, tb = tensorboard_events(run.spec.root)
    spelled = bridge_mlflow_names_on(
        pp2, set(memory_names(tb)) | set(REQUIRED_MEMORY) | {"memory/pp_stage_2/peak_host_rss_gb"}
    )
    check_required_memory(metrics, spell=spelled.__getitem__)
    assert memory_names(metrics) == sorted(spelled[name] for name in memory_names(tb)), (
        f"every memory series, spelled as Bridge {BRIDGE} spells its own MLflow names"
    )
    for name in memory_names(metrics):
        assert [s for s, _ in metrics[name]] == LOGGING_STEPS, f"{name}: once per Bridge logging step"
    peak = spelled["memory/peak_host_rss_gb"]
    for step, value in metrics[peak]:
        first = run.at(run.first_stage, step)
        assert first.peak_before <= value <= first.peak_after
        assert dict(metrics[spelled["memory/pp_stage_0/peak_host_rss_gb"]])[step] == value
    assert [v for _, v in metrics[spelled["memory/peak_stage/peak_host_rss_gb"]]] == [0, 0, 0]
    alone = mlflow_runs(bridge_alone.spec.mlflow_uri, "memlog-bridge")[0]["metrics"]
    assert sorted(n for n in metrics if not n.startswith("memory")) == sorted(
        n for n in alone if not n.startswith("memory")
    ), "Bridge's own MLflow series all there"
    assert params["logger.log_memory_to_tensorboard"] == "True", "the recorded config shows the user's setting"


# --- the callback's contract with the loop ----------------------------------------------------------


def test_takeover_flag_and_one_gather_per_logging_step_on_every_rank(with_callback):
    run = with_callback
    for record in run.records:
        assert [s.flag_seen_by_training_log for s in record.steps] == [True] * 6, (
            f"rank {record.rank}: the recipe's config as the user wrote it, at every step"
        )
        assert record.flag_after_run is True, f"rank {record.rank}: and after the run"
        for step in range(1, 7):
            calls = record.collectives[f"on_train_step_end@{step}"]
            if step == LOGGING_STEPS[0]:  # + the key-set handshake, once per group and process
                assert calls in ([GATHER, GATHER], [GATHER]), (record.rank, step, calls)
            else:
                assert calls == ([GATHER] if step in LOGGING_STEPS else []), (record.rank, step, calls)
        assert record.collectives["on_train_start"] == [] and record.collectives["on_train_end"] == []


def test_flag_off_costs_no_collective_and_writes_no_memory(flag_off):
    run = flag_off
    for record in run.records:
        fired = sorted(record.collectives)
        steps = [f"on_train_step_{edge}@{s}" for s in ALL_STEPS for edge in ("start", "end")]  # start: phases
        assert fired == sorted(["on_train_start", "on_train_end", *steps]), (
            "every event the callback handles fired (and was counted)"
        )
        assert all(calls == [] for calls in record.collectives.values()), (record.rank, record.collectives)
        assert [s.flag_seen_by_training_log for s in record.steps] == [False] * 6
        assert record.flag_after_run is False
        # One notice, on the writer rank (the last), naming the flag to set; none elsewhere.
        writer = record.rank == len(run.records) - 1
        flag_off = [text for text in record.notices if "set logger.log_memory_to_tensorboard=true" in text]
        assert len(flag_off) == (1 if writer else 0), (record.rank, record.notices)
    files, tb = tensorboard_events(run.spec.root)
    logs, history, _ = wandb_run(run.spec.root)
    (mlflow_run,) = mlflow_runs(run.spec.mlflow_uri, "memlog-bridge")
    assert len(files) == 1 and len(logs) == 1
    assert memory_names(tb) == [] and memory_names(mlflow_run["metrics"]) == []
    assert all(memory_names(row) == [] for row in history.values())
    check_bridge_metrics(run, tb, history, mlflow_run["metrics"])


def test_should_exit_path_hands_the_flag_back_for_the_next_run_of_the_same_config(pp2, tmp_path):
    """Bridge's exit_interval/signal/duration path calls sys.exit before on_train_end; a
    driver that catches it and trains the same config again must find the flag on."""
    spec = RunSpec(root=str(tmp_path), ballast_mb=BALLAST_MB, callback_kwargs=CALLBACK, backends=("tensorboard",))
    records = pp2.run_ok(exit_early_then_train_again, spec, 3, timeout=RUN_TIMEOUT_S)
    for exited, again in records:
        assert [s.step for s in exited.steps] == [1, 2, 3], "Bridge's own checkpoint_and_decide_exit ended run 1"
        assert "on_train_end" not in exited.collectives, "the exit path skips on_train_end"
        assert [s.step for s in again.steps] == ALL_STEPS
        assert [s.flag_seen_by_training_log for s in again.steps] == [True] * 6
        for step in LOGGING_STEPS:
            assert GATHER in again.collectives[f"on_train_step_end@{step}"], (
                f"rank {again.rank}: the second run's callback found the flag on and logs step {step}"
            )
        assert again.flag_after_run is True
    files, tb = tensorboard_events(spec.root)
    assert len(files) == 2, "one events file per run"
    assert sorted(s for s, _ in tb["memory/peak_host_rss_gb"]) == [2, 2, 4, 6], "run 1 until its exit, then run 2"
    assert not bridge_memory_names(tb)


# --- cost of an off-interval step (measured, not asserted on time) ------------------------------------


def test_off_interval_step_end_cost_on_every_rank(pp2dp2_bridge, tmp_path):
    results = pp2dp2_bridge.run_ok(bench_off_interval, 2000, str(tmp_path), timeout=RUN_TIMEOUT_S)
    for result in results:
        assert result["collectives"] == [], "off-interval: no collective"
    callback = statistics.median(r["callback_us"] for r in results)
    hook = statistics.median(r["training_log_us"] for r in results)
    print(
        f"\noff-interval cost, median per rank (us): callback on_train_step_end "
        f"{[round(r['callback_us'], 2) for r in results]}, nemo_memlog.training_log "
        f"{[round(r['training_log_us'], 2) for r in results]}; medians {callback:.2f} vs {hook:.2f}"
    )


@pytest.fixture(scope="module")
def with_phases(pp2, tmp_path_factory):
    """Saves at steps 2 and 4 (save_interval=2), an evaluation after step 3: stage 0 holds
    phase_ballast_mb inside each; logging steps 2 and 4, TensorBoard only."""
    return _run(
        pp2,
        tmp_path_factory.mktemp("phases"),
        callback_kwargs=CALLBACK,
        train_iters=4,
        save_interval=2,
        eval_at=(3,),
        backends=("tensorboard",),
    )


@pytest.mark.versions
def test_bridge_saves_and_evaluations_are_memory_phases_logged_at_the_next_logging_step(with_phases):
    run = with_phases
    _, tb = tensorboard_events(run.spec.root)
    # context.model / context.optimizer: the harness's Linear(8, 8) and plain SGD on every stage.
    assert tb["memory/params_gb"] == [(2, f32((8 * 8 + 8) * 4 / 1e9)), (4, f32((8 * 8 + 8) * 4 / 1e9))]
    assert [s for s, _ in tb["memory/model_state_gb"]] == [2, 4]  # (per stage: not in CALLBACK's keys)
    # Bridge's own estimate beside it, from 0.6 (its estimate_training_memory over the recipe's config):
    estimated = [name for name in tb if name.startswith("memory/estimate/")]
    if BRIDGE >= (0, 6):
        assert [s for s, _ in tb["memory/estimate/model_state_gb"]] == [2, 4] and tb["memory/estimate/model_state_gb"][
            0
        ][1] > 0
        assert "memory/estimate/activations_gb" in tb
    else:
        assert estimated == [], "0.3.1 has no estimator: nothing is logged for it"
    for name in ("checkpoint_save", "eval"):
        peak = tb[f"memory/phase/{name}/peak_host_rss_gb"]
        assert [s for s, _ in peak] == [4], (name, "the save at 2 and the evaluation at 3: logged at step 4")
        assert peak[0][1] > run.spec.phase_ballast_mb * 2**20 / 1e9
        assert tb[f"memory/peak_stage/phase/{name}/peak_host_rss_gb"] == [(4, 0)], "stage 0 held the ballast"
        assert [s for s, _ in tb[f"memory/phase/{name}/seconds"]] == [4]
    from nemo_memlog.offline.rank_files import find_record_files, read_rank_file

    (stage0,) = [p for p in find_record_files(run.spec.root) if read_rank_file(p).header["pp_rank"] == 0]
    phases = [(r["name"], r["event"], r["iteration"]) for r in read_rank_file(stage0).records if r["kind"] == "phase"]
    # The save at 4 is the last one: it ends at on_checkpoint_save (0.4+) or at on_train_end (0.3.1).
    assert phases == [
        ("checkpoint_save", "start", 2),
        ("checkpoint_save", "end", 2),
        ("eval", "start", 3),
        ("eval", "end", 3),
        ("checkpoint_save", "start", 4),
        ("checkpoint_save", "end", 4),
    ]


# --- the callback on megatron-core's GPTModel, in Bridge's own train_step ---------------------------

#: megatron_cpu's job (PP 2 x DP 2, GPTModel local spec, 4 layers, hidden 64, seq 64, Megatron's DDP and
#: Adam): at micro-batch size 2 with 4 microbatches, and the rerun at size 4 with 2 (the same samples).
MEGATRON_JOBS = {"micro_batch_size=2": megatron_cpu.JobSpec()}
MEGATRON_JOBS["micro_batch_size=4"] = dataclasses.replace(
    MEGATRON_JOBS["micro_batch_size=2"], micro_batch_size=4, microbatches=2
)
MODEL_STATE = ("params_gb", "grads_gb", "optimizer_state_gb")


#: Set by test_versions.py for its session of the second environment, which runs the GPTModel jobs on PP 2
#: alone (the ``pp2`` cluster its other tests use): what its versions change (Bridge's train_step,
#: megatron-core's layers and buffers) shows on one replica; DP 2 is held by this environment's session.
SECOND_ENVIRONMENT = os.environ.get("NEMO_MEMLOG_TESTS_SECOND_ENVIRONMENT") == "1"


@pytest.fixture(scope="module")
def bridge_megatron(request, tmp_path_factory):
    """Each job trained 2 iterations on the PP 2 x DP 2 cluster (PP 2 in the second environment), each
    iteration Bridge's own train_step, the callback logging (and recording per-layer figures) at step 2."""
    cluster = request.getfixturevalue("pp2" if SECOND_ENVIRONMENT else "pp2dp2_bridge")
    runs = {}
    for name, job in MEGATRON_JOBS.items():
        root = tmp_path_factory.mktemp(name.replace("=", "_"))
        spec = RunSpec(
            root=str(root),
            callback_kwargs=CALLBACK,
            megatron=job,
            train_iters=2,
            ballast_mb=0,
            backends=("tensorboard",),
        )
        runs[name] = Recorded(spec, cluster.run_ok(train, spec, timeout=RUN_TIMEOUT_S))
    return runs


@pytest.mark.versions
def test_callback_records_a_megatron_gptmodel_in_bridges_train_step_and_advise_predicts_the_rerun(bridge_megatron):
    from nemo_memlog import advice
    from nemo_memlog.offline import advise

    for name, run in bridge_megatron.items():
        for record in run.records:
            view = record.megatron
            assert view["layers"] is not None, f"{name}: rank {record.rank} wrote no per-layer record"
            assert view["layers"]["layers"], f"{name}: rank {record.rank}: no layer rows"
            assert view["layers"]["run"]["micro_batch_size"] == MEGATRON_JOBS[name].micro_batch_size
            assert view["layers"]["run"]["microbatches"] == MEGATRON_JOBS[name].microbatches
            stage = view["layers"]["stage"]
            assert stage["activations_gb"] > 0, (name, record.rank)
            for part in ("params", "grads", "optimizer_state"):  # Megatron's buffers and Adam's rule, to the byte
                assert round(stage[f"{part}_gb"] * 1e9) == view["apart"][part], (name, record.rank, part)
            losses = view["losses"]
            if record.pp_stage == 1:  # Bridge's train_step reduced the loss over the microbatches
                assert len(losses) == 2 and all(np.isfinite(loss) for loss in losses), losses
            else:
                assert losses == [None, None]
    run = advise.load(os.path.join(bridge_megatron["micro_batch_size=2"].spec.root, "memory_records"))
    rerun = {
        r.pp_stage: r.megatron["layers"]["stage"]
        for r in bridge_megatron["micro_batch_size=4"].records
        if r.dp_rank == 0
    }
    outcomes = advice.predict(run, advice.parse(["micro_batch_size=x2"]))
    assert sorted(o.stage for o in outcomes) == [0, 1]
    lines = []
    for outcome in outcomes:
        measured = rerun[outcome.stage]
        for part in ("activations_gb", *MODEL_STATE):
            predicted, rerun_mb = outcome.predicted[part], measured[part]
            lines.append(
                f"stage {outcome.stage} {part}: predicted {predicted * 1e3:.4f} MB, rerun {rerun_mb * 1e3:.4f} MB,"
                f" error {100 * (predicted - rerun_mb) / rerun_mb:+.2f}%"
            )
        assert outcome.predicted["activations_gb"] == pytest.approx(measured["activations_gb"], rel=0.10), outcome.stage
        for part in MODEL_STATE:
            assert outcome.predicted[part] == pytest.approx(measured[part], rel=0.01), (outcome.stage, part)
    print(f"\nBridge {BRIDGE}: advise micro_batch_size=x2 vs the rerun at 4:\n" + "\n".join(lines))
