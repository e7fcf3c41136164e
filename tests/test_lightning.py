"""MemoryLogCallback in a real Lightning Trainer: strategy="ddp" on CPU (gloo), 2 and 4 ranks.

One job per world size, both started at once (tests/lightning_job.py, started as a user starts a training
script; Lightning's launcher starts the other ranks), running several fits in the same
processes. Every rank holds a ballast of a known size, the largest on PEAK_RANK (neither
rank 0, where Lightning's loggers write, nor the last rank, where the core writes by
default). 8 optimizer steps, log_every_n_steps=2: Lightning logs train_loss at steps 1, 3,
5, 7 (``_batches_that_stepped``), and memory must land at exactly those steps.

- world 2: "main" (TensorBoard, CSV, MLflow on SQLite, W&B offline, Comet offline),
  "off" (TensorBoard and CSV, log_memory_to_tensorboard=False: zero collectives, and the
  baseline for Lightning's own series), "pl" (the pytorch_lightning package's Trainer,
  its own interval of 3), "accumulate" (accumulate_grad_batches=2).
- world 4: "main" with TensorBoard and CSV (the three client libraries' start-up, times 4
  processes on 2 cores, would cost more than the whole world-2 job), then "pp":
  megatron-core's parallel_state with PP 2 built in the same processes (standing in for
  NeMo 2's MegatronStrategy), groups {0,2} and {1,3}.
"""

from __future__ import annotations

import numpy as np
import pytest

from nemo_memlog.testing.collectives import GATHER
from tests.lightning_job import Job
from tests.lightning_readback import BACKENDS, runs, series

LOGGING_STEPS = [1, 3, 5, 7]
PEAK_RANK = {2: 1, 4: 2}
BALLAST_MB = {2: [40, 700], 4: [40, 80, 700, 120]}
CHEAP = ["tensorboard", "csv"]  # Lightning's own: no client library, no service, no archive
FITS = {
    2: [
        {"name": "main", "loggers": list(BACKENDS), "records": True},
        {"name": "off", "loggers": CHEAP, "callback": {"log_memory_to_tensorboard": False}},
        {"name": "pl", "package": "pytorch_lightning", "loggers": ["csv"], "callback": {"tensorboard_log_interval": 3}},
        {"name": "accumulate", "loggers": ["csv"], "accumulate": 2},
    ],
    4: [{"name": "main", "loggers": CHEAP}, {"name": "pp", "loggers": CHEAP, "pp": 2}],
}


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Both jobs, started at once on first use: each waits much of its time (its launcher
    starting ranks, the backends' services), and the other's work fills it."""
    jobs = {}
    try:
        for world in (2, 4):
            jobs[world] = Job(
                {"world": world, "ballast_mb": BALLAST_MB[world], "fits": FITS[world]},
                tmp_path_factory.mktemp(f"lightning_world{world}"),
            )
        yield jobs
    finally:
        for started_job in jobs.values():
            started_job.stop()


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def job(request, started):
    return started[request.param].result()


def memory_names(stored) -> list[str]:
    return sorted(name for name in stored if name.startswith("memory/"))


def own_series(stored) -> dict:
    return {name: values for name, values in stored.items() if not name.startswith("memory/")}


def as_stored(backend: str, value: float) -> float:
    """``value`` as ``backend`` stores it: TensorBoard keeps float32."""
    return float(np.float32(value)) if backend == "tensorboard" else value


# --- every backend: steps, attribution, one run, Lightning's series -------------------------------


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_at_lightnings_own_steps_in_one_run(job, backend):
    fit = job["main"]
    if backend not in fit.loggers:
        pytest.skip(f"{backend} is in the world-2 job")
    stored = series(backend, fit.root)
    assert runs(backend, fit.root) == 1, f"{backend}: one run, the Trainer's; the callback opens none"
    names = memory_names(stored)
    assert "memory/peak_host_rss_gb" in names and "memory/peak_rank/peak_host_rss_gb" in names, names
    # pl_module and trainer.optimizers: the TinyModel's Linear(8, 1), 9 float32 parameters, plain SGD
    assert [v for _, v in stored["memory/params_gb"]] == pytest.approx([9 * 4 / 1e9] * len(LOGGING_STEPS), rel=1e-6)
    # activations, counted by hand: the Linear saves its (4, 8) input, mse_loss its (4, 1) input and
    # target, float32: 160 bytes held by the one batch of each logging step, measured on every rank
    held = stored["memory/activations_gb"]
    assert [v for _, v in held] == pytest.approx([160 / 1e9] * len(LOGGING_STEPS), rel=1e-6)
    assert [v for _, v in stored["memory/microbatches_in_flight"]] == [1] * len(LOGGING_STEPS)
    assert [s for s, _ in stored["train_loss"]] == LOGGING_STEPS, "Lightning's own logging steps"
    for name in names:
        assert [s for s, _ in stored[name]] == LOGGING_STEPS, f"{backend} {name}: once at each of Lightning's steps"


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_max_is_the_ballast_ranks_own_peak_and_its_rank_is_logged_beside_it(job, backend):
    fit = job["main"]
    if backend not in fit.loggers:
        pytest.skip(f"{backend} is in the world-2 job")
    peak_rank = PEAK_RANK[fit.world]
    stored = series(backend, fit.root)
    for step, value in stored["memory/peak_host_rss_gb"]:
        event = fit.at(peak_rank, step)
        low, high = as_stored(backend, event["peak_before"]), as_stored(backend, event["peak_after"])
        assert low <= value <= high, (backend, step, value, event)
        others = [fit.at(r, step)["peak_after"] for r in range(fit.world) if r != peak_rank]
        assert value > max(others) + 0.3, "the ballast rank stands clear of every other rank"
    assert [v for _, v in stored["memory/peak_rank/peak_host_rss_gb"]] == [peak_rank] * len(LOGGING_STEPS)
    assert [v for _, v in stored["memory/peak_stage/peak_host_rss_gb"]] == [0] * len(LOGGING_STEPS), (
        "no pipeline: every rank is stage 0"
    )


@pytest.mark.processes
@pytest.mark.slow
def test_a_clean_end_leaves_every_ranks_flight_record_closed(job):
    """on_train_end ends the flight record itself (the garbage collector ran before the job's
    exit): the post-mortem of a clean fit finds every rank closed, and no failure."""
    from tests.readback import postmortem

    fit = job["main"]
    if fit.world != 2:
        pytest.skip("the records are kept in the world-2 job")
    status, found = postmortem(fit.root / "memory_records")
    assert status == 0 and found["first_failure"] is None, found["sentence"]
    assert [(r["status"], r["end_reason"]) for r in found["ranks"]] == [("closed", "close")] * 2, found
    # the per-layer records beside them carry the run's facts: the DataLoader's batch_size=4, no accumulation
    from nemo_memlog.measure import layer_record

    records = layer_record.read_folder(fit.root / "memory_records")
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["run"]["micro_batch_size"] == 4 and r["run"]["microbatches"] == 1 for r in records), records


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_lightnings_own_series_unchanged(job, backend):
    fit = job["main"]
    if backend not in fit.loggers:
        pytest.skip(f"{backend} is in the world-2 job")
    stored = own_series(series(backend, fit.root))
    stored.pop("process duration", None)  # Comet's: the run's wall-clock time, logged at its end
    losses = [as_stored(backend, fit.at(0, step)["loss"]) for step in LOGGING_STEPS]
    assert sorted(stored) == ["epoch", "train_loss"], "no series of ours outside memory/"
    assert stored["epoch"] == [(step, 0) for step in LOGGING_STEPS]
    assert [s for s, _ in stored["train_loss"]] == LOGGING_STEPS
    assert [v for _, v in stored["train_loss"]] == pytest.approx(losses, rel=1e-12), "rank 0's loss, unchanged"
    off = job.get("off")  # the same job with memory logging off: every series of Lightning's, equal
    if off is not None and backend in off.loggers:
        assert stored == own_series(series(backend, off.root))


# --- the contract with the loop: collectives ------------------------------------------------------


@pytest.mark.processes
@pytest.mark.slow
def test_one_gather_per_logging_step_on_every_rank_and_none_elsewhere(job):
    fit = job["main"]
    for rank in range(fit.world):
        events = fit.ranks[rank]
        assert [e["hook"] for e in events] == ["on_train_start"] + ["on_train_batch_end"] * 8 + ["on_train_end"]
        # Placed at on_train_start; no pipeline group here, so the world is reduced, and placement
        # gathers where every rank sits, once (the steps then carry memory only).
        assert events[0]["collectives"] == [GATHER] and events[-1]["collectives"] == []
        for event in fit.batch_ends(rank):
            expected = [GATHER] if event["step"] in LOGGING_STEPS else []
            if event["step"] == LOGGING_STEPS[0]:  # + the key-set handshake, once per group and process
                assert event["collectives"] in ([GATHER, GATHER], [GATHER]), (rank, event)
            else:
                assert event["collectives"] == expected, (rank, event)
            assert event["step"] == event["global_step"] - 1, "_batches_that_stepped is global_step - 1 here"


@pytest.mark.processes
@pytest.mark.slow
def test_flag_off_zero_collectives_and_no_memory_anywhere(job):
    if "off" not in job:
        pytest.skip("the flag-off fit runs in the world-2 job")
    fit = job["off"]
    for rank in range(fit.world):
        assert len(fit.ranks[rank]) == 10, "every hook the callback handles fired (and was counted)"
        assert all(e["collectives"] == [] for e in fit.ranks[rank]), (rank, fit.ranks[rank])
    for backend in fit.loggers:
        assert memory_names(series(backend, fit.root)) == [], backend


# --- pytorch_lightning, and the pipeline path ------------------------------------------------------


@pytest.mark.processes
@pytest.mark.slow
def test_pytorch_lightning_trainer_with_its_own_interval(job):
    if "pl" not in job:
        pytest.skip("the pytorch_lightning fit runs in the world-2 job")
    fit = job["pl"]
    stored = series("csv", fit.root)
    own_steps = [2, 5]  # tensorboard_log_interval=3: (step + 1) % 3 == 0, as log_every_n_steps counts
    assert [s for s, _ in stored["train_loss"]] == LOGGING_STEPS, "Lightning's own interval is untouched"
    for name in memory_names(stored):
        assert [s for s, _ in stored[name]] == own_steps, name
    for step, value in stored["memory/peak_host_rss_gb"]:
        assert fit.within_peak(PEAK_RANK[2], step, value)
    for rank in range(2):
        gathers = [e["step"] for e in fit.batch_ends(rank) if e["collectives"]]
        assert gathers == own_steps, rank


@pytest.mark.processes
@pytest.mark.slow
def test_gradient_accumulation_logs_once_per_step_on_the_optimizer_stepping_batch(job):
    if "accumulate" not in job:
        pytest.skip("the accumulation fit runs in the world-2 job")
    fit = job["accumulate"]
    stored = series("csv", fit.root)
    for name in memory_names(stored):
        assert [s for s, _ in stored[name]] == LOGGING_STEPS, name
    for rank in range(2):
        ends = fit.batch_ends(rank)
        assert len(ends) == 16, "2 batches per optimizer step"
        gathered = [(e["step"], e["global_step"]) for e in ends if e["collectives"]]
        assert gathered == [(s, s + 1) for s in LOGGING_STEPS], "after the optimizer step of the window"
    for step, value in stored["memory/peak_host_rss_gb"]:
        assert fit.within_peak(PEAK_RANK[2], step, value)


@pytest.mark.processes
@pytest.mark.slow
def test_pipeline_group_when_megatron_parallel_state_is_initialised(job):
    if "pp" not in job:
        pytest.skip("the PP fit runs in the world-4 job")
    fit = job["pp"]  # PP 2 over 4 ranks: rank 0's pipeline is ranks 0 (stage 0) and 2 (stage 1)
    for backend in ("tensorboard", "csv"):
        stored = series(backend, fit.root)
        assert runs(backend, fit.root) == 1
        assert "memory/pp_stage_2/peak_host_rss_gb" not in stored, "two stages"
        assert not any(name.startswith("memory/peak_rank/") for name in stored), "the pp scope, not world"
        for step, value in stored["memory/peak_host_rss_gb"]:
            assert step in LOGGING_STEPS
            stage0 = dict(stored["memory/pp_stage_0/peak_host_rss_gb"])[step]
            stage1 = dict(stored["memory/pp_stage_1/peak_host_rss_gb"])[step]
            assert (
                as_stored(backend, fit.at(0, step)["peak_before"])
                <= stage0
                <= as_stored(backend, fit.at(0, step)["peak_after"])
            )
            assert (
                as_stored(backend, fit.at(2, step)["peak_before"])
                <= stage1
                <= as_stored(backend, fit.at(2, step)["peak_after"])
            )
            assert value == stage1 and stage1 > stage0 + 0.3, "the max is stage 1's (rank 2's ballast)"
            assert dict(stored["memory/peak_stage/peak_host_rss_gb"])[step] == 1
        assert [s for s, _ in stored["memory/peak_host_rss_gb"]] == LOGGING_STEPS
    for rank in range(4):  # every rank gathers over its own pipeline, at the same steps
        gathers = [e["step"] for e in fit.batch_ends(rank) if e["collectives"]]
        assert gathers == LOGGING_STEPS, rank


# --- in this process: settings, the writer over Lightning's loggers, the writer rank --------------


def test_settings_are_logger_config_names_unknown_ones_raise_listing_the_valid_ones():
    from nemo_memlog.lightning import SETTINGS, MemoryLogCallback

    with pytest.raises(ValueError) as raised:
        MemoryLogCallback(tensorboard_dir="runs/tb", memory_reduce_scope="world")
    message = str(raised.value)
    assert "['tensorboard_dir']" in message and "Trainer's own loggers" in message
    assert all(repr(name) in message for name in SETTINGS), "every valid name is listed"
    with pytest.raises(ValueError, match="memory_reduce_scope must be 'pp' or 'world'"):
        MemoryLogCallback(memory_reduce_scope="everywhere")
    with pytest.raises(ValueError, match="tensorboard_log_interval must be an int >= 1"):
        MemoryLogCallback(tensorboard_log_interval=0)
    callback = MemoryLogCallback(tensorboard_log_interval=None, memory_peak_window="interval")
    assert callback.settings == {"log_memory_to_tensorboard": True, "memory_peak_window": "interval"}, (
        "None: Lightning's log_every_n_steps"
    )


def test_the_callback_is_a_callback_of_both_lightning_packages():
    import lightning.pytorch
    import pytorch_lightning

    from nemo_memlog.lightning import MemoryLogCallback

    callback = MemoryLogCallback()
    assert isinstance(callback, lightning.pytorch.Callback) and isinstance(callback, pytorch_lightning.Callback)


def test_a_lightning_logger_is_adopted_and_written_through_its_own_log_metrics(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from nemo_memlog.writers import adopt_writers

    class OwnLogger(CSVLogger):  # a user's logger: recognised by its Lightning base class
        pass

    writers = adopt_writers([object(), CSVLogger(str(tmp_path), name="csv"), OwnLogger(str(tmp_path), name="own")])
    assert writers.backend_names == ["lightning", "lightning"], "both Lightning loggers, nothing else"
    metrics = {"memory/peak_host_rss_gb": 1.5, "memory/peak_rank/peak_host_rss_gb": 3}
    writers.log(metrics, 7)  # no flush or close: log_metrics is followed by save(), as Lightning does
    assert metrics == {"memory/peak_host_rss_gb": 1.5, "memory/peak_rank/peak_host_rss_gb": 3}, "not mutated"
    expected = {"memory/peak_host_rss_gb": [(7, 1.5)], "memory/peak_rank/peak_host_rss_gb": [(7, 3.0)]}
    assert series("csv", tmp_path) == expected
    (own_csv,) = (tmp_path / "own").glob("version_*/metrics.csv")
    assert own_csv.read_text().splitlines()[1:] == ["1.5,3,7"], "saved at once, as Lightning saves its own"


def _writer_flags(writer_rank, record_dir):
    from nemo_memlog.config import LoggerConfig
    from nemo_memlog.monitor import MemoryMonitor

    config = LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir=record_dir)
    monitor = MemoryMonitor(config, writer_rank=writer_rank, writers=[])
    try:
        monitor.place()
    except ValueError as error:
        return str(error)
    finally:
        monitor.end_record()  # in record_dir: the shared cluster's ranks live on
    return monitor.is_writer_rank


@pytest.mark.processes
def test_the_monitor_writes_on_the_writer_rank_it_is_given(pp2dp2, tmp_path):
    def flags(writer_rank):
        return pp2dp2.run_ok(_writer_flags, writer_rank, str(tmp_path / f"records_{writer_rank}"))

    assert flags(None) == [False, False, False, True], "default: the last rank"
    assert flags(0) == [True, False, False, False], "Lightning's: global rank 0"
    errors = flags(4)
    assert all("writer_rank=4 is not a rank of this job (world size 4)" in e for e in errors), errors


def test_an_error_in_a_hook_of_ours_is_one_notice_and_the_trainer_trains_on(tmp_path, monkeypatch):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from nemo_memlog.lightning import MemoryLogCallback
    from nemo_memlog.monitor import MemoryMonitor
    from nemo_memlog.testing.notices import said
    from tests.lightning_job import make_module

    def fails(self, *args, **kwargs):  # a logging step that fails (a reduction, a backend): provoked here
        raise RuntimeError("a logging step failed")

    monkeypatch.setattr(MemoryMonitor, "log_step", fails)
    callback = MemoryLogCallback(memory_record_dir="off")
    trainer = pl.Trainer(
        max_steps=4,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(str(tmp_path), name="csv"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    with said() as caught:
        trainer.fit(make_module(pl))
    assert trainer.global_step == 4, "trained to its end"
    stopped = [text for text in caught if "memory logging stopped" in text]
    assert stopped == [
        "nemo_memlog: memory logging stopped in Lightning's Trainer (on_train_batch_end): "
        "RuntimeError('a logging step failed'); training goes on without it"
    ]
    assert callback.stopped and callback.monitor is None
