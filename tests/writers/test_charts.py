"""The per-stage charts drawn at close: a legend that stays readable at any pipeline depth, peaks
that survive the cut to LINE_POINTS, and a close that ends the run within its budget at PP 64 x 12
metrics x 2000 steps (what does not fit is skipped and said)."""

import math
import time

import pytest

from nemo_memlog.config import LoggerConfig
from nemo_memlog.testing.notices import said
from nemo_memlog.writers import charts, comet
from nemo_memlog.writers import mlflow as mlflow_writer
from nemo_memlog.writers import wandb as wandb_writer
from nemo_memlog.writers.fanout import BufferedBackend, ThreadFanOut
from nemo_memlog.writers.stages import MAX_LINE, StageHistory

SPIKE_STAGE, SPIKE_STEP, SPIKE = 7, 1237, 99.0


def stage_value(step: int, stage: int, metric: int) -> float:
    """Stage s sits near 10 + s/10 (so the highest stages peak highest), but for one spike of stage 7."""
    if (stage, step) == (SPIKE_STAGE, SPIKE_STEP):
        return SPIKE + metric
    return 10 + stage / 10 + metric + math.sin(step / 40 + stage) / 20


def step_metrics(step: int, stages: int, metrics: int) -> dict:
    out = {"loss": 1.0}
    for metric in range(metrics):
        values = [stage_value(step, stage, metric) for stage in range(stages)]
        out[f"memory/m{metric}_gb"] = max(values)
        out.update({f"memory/pp_stage_{stage}/m{metric}_gb": value for stage, value in enumerate(values)})
    return out


def history_of(stages: int, steps: int, metrics: int = 1) -> StageHistory:
    history = StageHistory()
    for step in range(steps):
        history.add(step_metrics(step, stages, metrics), step)
    return history


def test_at_64_stages_a_chart_shows_the_max_median_range_and_the_five_highest_stages():
    history = history_of(64, 2000)
    lines = charts.chart_lines(history, "memory/m0_gb")
    labels = [line.label for line in lines]
    # The highest peaks, counted apart from the product: stage 7's spike, then the deepest stages.
    peaks = {s: max(stage_value(step, s, 0) for step in range(2000)) for s in range(64)}
    top = sorted(peaks, key=lambda s: -peaks[s])[: charts.TOP_STAGES]
    assert top[0] == SPIKE_STAGE
    assert labels == [MAX_LINE, charts.MEDIAN_LINE, charts.RANGE_BAND, *(f"pp_stage_{s}" for s in top)]
    assert len(labels) <= 8
    for line in lines:
        assert len(line.steps) <= charts.LINE_POINTS
        assert line.steps == sorted(line.steps)
    by_label = {line.label: line for line in lines}
    for label in (MAX_LINE, f"pp_stage_{SPIKE_STAGE}"):  # the spike survives the cut, at its own step
        line = by_label[label]
        assert max(line.values) == SPIKE and line.steps[line.values.index(SPIKE)] == SPIKE_STEP
    band = by_label[charts.RANGE_BAND]
    lowest = min(min(history.lines("memory/m0_gb")[f"pp_stage_{s}"][1]) for s in range(64))
    assert max(band.high) == SPIKE and min(band.values) == pytest.approx(lowest)
    median = by_label[charts.MEDIAN_LINE]
    assert 10 + 3.0 < max(median.values) < 10 + 3.4  # the middle stages' level, not the spike's

    figure = charts.draw("memory/m0_gb", lines)  # the drawn legend holds exactly those entries
    (axes,) = figure.axes
    assert [text.get_text() for text in axes.get_legend().get_texts()] == labels


def test_up_to_ten_stages_every_stage_is_drawn_and_a_short_line_is_kept_whole():
    history = history_of(10, 50)
    lines = charts.chart_lines(history, "memory/m0_gb")
    assert [line.label for line in lines] == [MAX_LINE, *(f"pp_stage_{s}" for s in range(10))]
    assert all(line.steps == list(range(50)) for line in lines)
    series = charts.as_series(charts.chart_lines(history_of(12, 5), "memory/m0_gb"))
    assert list(series)[:3] == [MAX_LINE, charts.MEDIAN_LINE, charts.MIN_LINE]  # a band as its low edge


def test_bucket_max_keeps_each_buckets_highest_point():
    steps = list(range(10))
    values = [0, 5, 1, 1, 9, 2, 3, 3, 3, 8]
    assert charts.bucket_max(steps, values, points=4) == ([1, 4, 6, 9], [5, 9, 3, 8])  # a tie: the first
    assert charts.bucket_max(steps, values, points=10) == (steps, values)


def mlflow_backend(tmp_path, budget: float, stages: int, metrics: int, steps: int):
    """An MLflow backend on a SQLite store with ``steps`` steps of a PP ``stages`` run held for its
    charts. Only the last 3 steps go through log_batch (one 780-metric step takes ~0.15 s here, so
    2000 would take minutes); the others are handed to its history as ``log`` itself does."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = LoggerConfig(
        mlflow_experiment="charts", mlflow_run_name="pp64", mlflow_tracking_uri=uri, writer_close_timeout_s=budget
    )
    backend = mlflow_writer.open_backend(cfg, {}, [])
    for step in range(steps - 3):
        backend.history.add(step_metrics(step, stages, metrics), step)
    return backend, uri


def close_through_the_fanout(backend, name: str, last_steps: list, budget: float) -> tuple[float, list]:
    """``last_steps`` (step, metrics) logged through a real thread fan-out around ``backend``, then
    its close with ``budget``: (seconds the close took, the notices said)."""
    fanout = ThreadFanOut([BufferedBackend(name, lambda: backend, 100, [])], budget, closes_with_process=False)
    with said(warned=False) as notices:
        for step, metrics in last_steps:
            fanout.log(metrics, step)
        assert fanout.flush()
        started = time.monotonic()
        fanout.close()
        took = time.monotonic() - started
    return took, notices


def check_mlflow_closed(uri, backend, took, notices, metrics):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    assert client.get_run(backend.run_id).info.status == "FINISHED"
    # Within the budget by the close's own deadline: a backend still closing at it is said (and the
    # close returns then, whatever the backend does; ``took`` is printed, not bounded).
    assert not [m for m in notices if "did not finish closing in time" in m], (took, notices)
    pngs = [
        f.path for f in client.list_artifacts(backend.run_id, mlflow_writer.CHARTS_FOLDER) if f.path.endswith(".png")
    ]
    skipped = [m for m in notices if "per-stage charts were not drawn" in m]
    if len(pngs) < metrics:
        assert len(skipped) == 1, notices
        assert f"{metrics - len(pngs)} of the {metrics} per-stage charts" in skipped[0]
        assert "writer_close_timeout_s" in skipped[0] and "charts.json" in skipped[0]
    else:
        assert not skipped, notices
    return len(pngs)


def test_mlflow_at_pp64_x_12_metrics_x_2000_steps_closes_finished_within_the_budget(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    budget, stages, metrics, steps = 25.0, 64, 12, 2000
    backend, uri = mlflow_backend(tmp_path, budget, stages, metrics, steps)
    last = [(step, step_metrics(step, stages, metrics)) for step in range(steps - 3, steps)]
    took, notices = close_through_the_fanout(backend, "mlflow", last, budget)
    drawn = check_mlflow_closed(uri, backend, took, notices, metrics)
    print(f"PP {stages} x {metrics} x {steps}: close {took:.1f} s, {drawn} of {metrics} charts drawn")


def test_mlflow_a_budget_too_short_for_any_chart_skips_them_says_so_and_still_finishes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    budget, stages, metrics, steps = 3.0, 64, 12, 200  # less than the reserve plus one chart
    backend, uri = mlflow_backend(tmp_path, budget, stages, metrics, steps)
    last = [(step, step_metrics(step, stages, metrics)) for step in range(steps - 3, steps)]
    took, notices = close_through_the_fanout(backend, "mlflow", last, budget)
    assert check_mlflow_closed(uri, backend, took, notices, metrics) == 0
    from mlflow.tracking import MlflowClient

    files = {f.path for f in MlflowClient(uri).list_artifacts(backend.run_id, mlflow_writer.CHARTS_FOLDER)}
    assert files == {f"{mlflow_writer.CHARTS_FOLDER}/charts.json"}  # the lines are kept as data


def test_comet_at_many_stages_logs_readable_figures_and_ends(tmp_path):
    from tests.readback import read_archive

    cfg = LoggerConfig(comet_project="memlog-test", comet_offline_directory=str(tmp_path / "offline"))
    backend = comet.open_backend(cfg, {}, [])
    for step in range(40):
        backend.log(step_metrics(step, 16, 2), step)
    drawn = []
    backend.experiment.log_figure = lambda figure_name, figure: drawn.append(figure)
    backend.close()
    (archive,) = (tmp_path / "offline").glob("*.zip")  # the experiment ended: its archive is written
    assert read_archive(archive)
    assert len(drawn) == 2
    for figure in drawn:
        legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
        assert legend[:3] == [MAX_LINE, charts.MEDIAN_LINE, charts.RANGE_BAND] and len(legend) == 8


@pytest.mark.processes
def test_wandb_at_many_stages_charts_the_same_lines_as_the_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("XDG_CACHE_HOME", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    backend = wandb_writer.open_backend(LoggerConfig(wandb_project="memlog-test", wandb_save_dir=str(tmp_path)), {}, [])
    for step in range(40):
        backend.log(step_metrics(step, 16, 1), step)
    built = backend.charts(time.monotonic() + 60)
    (chart,) = built.values()
    keys = list(dict.fromkeys(row[1] for row in chart.table.data))
    expected = charts.as_series(charts.chart_lines(backend.history, "memory/m0_gb"))
    assert keys == list(expected) and len(keys) == 8
    backend.close()
