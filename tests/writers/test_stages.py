"""Every stage of one metric in one chart, in each backend's own way, read back from what it
wrote: TensorBoard one run per stage under the max's tag (owned and adopted writers), W&B a
custom chart per metric, MLflow and Comet a figure and the lines as data, each at close."""

import errno
import json
import math
import os
import re

import pytest

from nemo_memlog.config import LoggerConfig
from nemo_memlog.testing.notices import said
from nemo_memlog.writers import adopt_writers, comet, tensorboard
from nemo_memlog.writers import mlflow as mlflow_writer
from nemo_memlog.writers import wandb as wandb_writer
from nemo_memlog.writers.stages import MAX_LINE, StageHistory
from tests.readback import read_archive, tensorboard_runs
from tests.writers.sample import STAGE_STEPS, STAGE_TAGS, STAGES, STEPS, stage_value, write_steps

LABELS = [f"pp_stage_{stage}" for stage in range(STAGES)]


def f32(value):
    import numpy

    return float(numpy.float32(value))


def write_stage_steps(backend):
    for step, metrics in STAGE_STEPS.items():
        before = repr(metrics)
        backend.log(metrics, step)
        assert repr(metrics) == before  # log never mutates


def check_stage_runs(runs, main="."):
    """The max in the main run, each stage's own value in its own run under the same tag, at the same steps."""
    stage_runs = {f"{main}/{label}" if main != "." else label: label for label in LABELS}
    assert set(runs) == {main, *stage_runs}, sorted(runs)
    steps = sorted(STAGE_STEPS)
    for tag in STAGE_TAGS:
        assert runs[main][tag] == [(step, f32(STAGE_STEPS[step][tag])) for step in steps], tag
        for run, label in stage_runs.items():
            stage = int(label.removeprefix("pp_stage_"))
            assert runs[run][tag] == [(step, f32(stage_value(step, stage, tag))) for step in steps], (run, tag)
    for run in stage_runs:
        assert set(runs[run]) == set(STAGE_TAGS), "a stage's run holds its own series only"
    # The main run keeps every key of the unified dict (per-stage tags included: nemo-memlog report reads them).
    assert set(STAGE_STEPS[5]) <= set(runs[main])


def test_tensorboard_writes_each_stage_in_a_run_of_its_own_under_the_max_tag(tmp_path):
    cfg = LoggerConfig(tensorboard_dir=str(tmp_path / "tb"))
    backend = tensorboard.open_backend(cfg, {}, [])
    write_stage_steps(backend)
    backend.close()
    check_stage_runs(tensorboard_runs(tmp_path / "tb"))
    # One event file per run: the main one where it always was.
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1


def test_tensorboard_layout_charts_each_stage_metric_over_every_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    backend = tensorboard.open_backend(LoggerConfig(tensorboard_dir=str(tmp_path / "tb")), {}, [])
    first = {f"memory/pp_stage_{stage}/params_gb": 1.0 for stage in range(2)}
    backend.log({**first, "memory/params_gb": 1.0, "loss": 1.0}, 1)
    backend.log(first, 2)  # nothing new: the layout is not written again
    backend.log({**first, "memory/pp_stage_1/temporaries_gb": 0.5}, 3)  # a new name: a new chart
    backend.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0}).Reload()
    records = events.Tensors("custom_scalars__config__")
    layouts = [layout_pb2.Layout.FromString(r.tensor_proto.string_val[0]) for r in records]
    assert len(layouts) == 2
    for layout, names in zip(layouts, [{"params_gb"}, {"params_gb", "temporaries_gb"}]):
        [category] = layout.category
        assert category.title == tensorboard.LAYOUT_CATEGORY
        assert {chart.title for chart in category.chart} == names
        for chart in category.chart:
            [regex] = chart.multiline.tag
            tags = {"memory/params_gb", "memory/temporaries_gb", "memory/pp_stage_0/params_gb", "loss"}
            assert {tag for tag in tags if re.match(regex, tag)} == {f"memory/{chart.title}"}
    runs = tensorboard_runs(tmp_path / "tb")
    assert runs["pp_stage_1"]["memory/temporaries_gb"] == [(3, 0.5)] and "memory/temporaries_gb" not in runs["."]


def test_tensorboard_one_stage_writes_no_stage_run(tmp_path):
    backend = tensorboard.open_backend(LoggerConfig(tensorboard_dir=str(tmp_path / "tb")), {}, [])
    write_steps(backend)  # memory/pp_stage_0/... only
    backend.close()
    assert list(tensorboard_runs(tmp_path / "tb")) == ["."]
    assert [p.name for p in (tmp_path / "tb").iterdir() if p.is_dir()] == []


def test_an_adopted_writer_gets_stage_runs_beside_it_flushed_at_each_step_and_stays_open(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    opened = SummaryWriter(log_dir=str(tmp_path / "bridge" / "tb"))  # Bridge's own writer
    writers = adopt_writers([opened])
    assert writers.backend_names == ["tensorboard"]
    write_stage_steps(writers)
    for label in LABELS:  # on disk before any flush or close: the framework may end without closing us
        runs = tensorboard_runs(tmp_path / "bridge" / "tb")
        assert runs[label]["memory/peak_reserved_gb"][-1][0] == 20
    writers.close()  # ours to flush (stage runs stay ours), the opener's to close
    opened.add_scalar("bridge/loss", 1.0, 30)  # the opener still writes after us
    opened.close()
    runs = tensorboard_runs(tmp_path / "bridge" / "tb")
    check_stage_runs(runs)
    assert runs["."]["bridge/loss"] == [(30, 1.0)]


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("XDG_CACHE_HOME", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    return tmp_path


@pytest.mark.processes
def test_wandb_logs_one_custom_chart_per_stage_metric_at_close(offline_wandb):
    from tests.bridge_readback import wandb_run

    root = offline_wandb
    cfg = LoggerConfig(wandb_project="memlog-test", wandb_save_dir=str(root / "runs"))
    backend = wandb_writer.open_backend(cfg, {}, [])
    write_stage_steps(backend)
    backend.close()
    _, history, _ = wandb_run(root / "runs")
    steps = sorted(STAGE_STEPS)
    assert sorted(history)[: len(steps)] == steps
    for step in steps:  # every key as before, in the row of its step
        for key, value in STAGE_STEPS[step].items():
            assert history[step][key] == pytest.approx(value), (step, key)
    (last,) = [history[step] for step in sorted(history)[len(steps) :]]  # the charts: a row after the last step
    for tag in STAGE_TAGS:
        key = wandb_writer.CHART_SECTION + tag.removeprefix("memory/")
        # W&B files a custom chart's data as a table, "<key>_table", in the run's media folder.
        path = last[f"{key}_table/path"]
        (table,) = [p for p in (root / "runs").rglob("*.table.json") if p.as_posix().endswith(path)]
        data = json.loads(table.read_text())
        assert data["columns"] == ["step", "lineKey", "lineVal"]
        lines = {}
        for step, line, value in data["data"]:
            lines.setdefault(line, []).append((step, value))
        assert list(lines) == [MAX_LINE, *LABELS]
        assert lines[MAX_LINE] == [(step, pytest.approx(STAGE_STEPS[step][tag])) for step in steps]
        for stage, label in enumerate(LABELS):
            assert lines[label] == [(step, pytest.approx(stage_value(step, stage, tag))) for step in steps]


@pytest.mark.processes
def test_wandb_one_stage_logs_no_chart(offline_wandb):
    from tests.bridge_readback import wandb_run

    cfg = LoggerConfig(wandb_project="memlog-test", wandb_save_dir=str(offline_wandb / "runs"))
    backend = wandb_writer.open_backend(cfg, {}, [])
    write_steps(backend)
    backend.close()
    _, history, _ = wandb_run(offline_wandb / "runs")
    assert sorted(history) == sorted(STEPS)


def test_mlflow_run_gets_a_png_and_the_lines_per_stage_metric_at_close(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = LoggerConfig(mlflow_experiment="memlog-test", mlflow_run_name="pp", mlflow_tracking_uri=uri)
    backend = mlflow_writer.open_backend(cfg, {}, [])
    write_stage_steps(backend)
    backend.close()
    client = MlflowClient(uri)
    for tag in STAGE_TAGS:  # the metrics as before
        for stage in range(STAGES):
            name = mlflow_writer.mlflow_name(tag.replace("memory/", f"memory/pp_stage_{stage}/"))
            history = sorted((m.step, m.value) for m in client.get_metric_history(backend.run_id, name))
            assert history == [(step, pytest.approx(stage_value(step, stage, tag))) for step in sorted(STAGE_STEPS)]
    files = {f.path for f in client.list_artifacts(backend.run_id, mlflow_writer.CHARTS_FOLDER)}
    assert files == {
        f"{mlflow_writer.CHARTS_FOLDER}/{name}" for name in ("charts.json", "peak_reserved_gb.png", "weird key*(1).png")
    }
    folder = client.download_artifacts(backend.run_id, mlflow_writer.CHARTS_FOLDER, str(tmp_path / "got"))
    charts = json.loads((tmp_path / "got" / mlflow_writer.CHARTS_FOLDER / "charts.json").read_text())
    assert list(charts) == list(STAGE_TAGS)
    for tag in STAGE_TAGS:
        assert list(charts[tag]) == [MAX_LINE, *LABELS]
        for stage, label in enumerate(LABELS):
            assert charts[tag][label]["steps"] == sorted(STAGE_STEPS)
            assert charts[tag][label]["values"] == [stage_value(step, stage, tag) for step in sorted(STAGE_STEPS)]
    png = (tmp_path / "got" / mlflow_writer.CHARTS_FOLDER / "peak_reserved_gb.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and folder


def test_comet_experiment_gets_a_figure_and_the_lines_per_stage_metric_at_its_end(tmp_path):
    cfg = LoggerConfig(comet_project="memlog-test", comet_offline_directory=str(tmp_path / "offline"))
    backend = comet.open_backend(cfg, {}, [])
    write_stage_steps(backend)
    backend.close()
    import zipfile

    (archive,) = (tmp_path / "offline").glob("*.zip")
    _, messages = read_archive(archive)
    stored = {
        (m["payload"]["metric"]["metricName"], m["payload"]["metric"]["step"]): m["payload"]["metric"]["metricValue"]
        for m in messages
        if m["type"] == "metric_msg"
    }
    for step, metrics in STAGE_STEPS.items():
        for key, value in metrics.items():
            assert stored[key, step] == pytest.approx(value), (key, step)
    uploads = [m["payload"] for m in messages if m["type"] == "file_upload"]
    figures = {u["additional_params"]["figName"] for u in uploads if u["upload_type"] == "visualization"}
    assert figures == {"memory per stage: peak_reserved_gb", "memory per stage: weird key*(1)"}
    (asset,) = [u for u in uploads if u["upload_type"] == "asset"]
    assert asset["additional_params"]["fileName"] == comet.CHARTS_ASSET
    with zipfile.ZipFile(archive) as z:
        charts = json.loads(z.read(asset["file_path"]))
    for tag in STAGE_TAGS:
        assert list(charts[tag]) == [MAX_LINE, *LABELS]
        assert charts[tag][MAX_LINE]["values"] == [STAGE_STEPS[step][tag] for step in sorted(STAGE_STEPS)]


def test_history_thins_evenly_keeps_the_first_step_and_drops_non_finite_points():
    history = StageHistory(max_points=4)
    for step in range(10, 400, 10):
        value = math.nan if step == 10 else float(step)
        history.add({"memory/a": value, "memory/pp_stage_0/a": value, "memory/pp_stage_1/a": 1.0}, step)
    lines = history.lines("memory/a")
    assert list(lines) == [MAX_LINE, "pp_stage_0", "pp_stage_1"]
    steps = lines["pp_stage_1"][0]
    assert 4 <= len(steps) <= 8 and steps[0] == 10
    assert len({b - a for a, b in zip(steps, steps[1:])}) == 1, steps  # evenly spaced
    assert lines[MAX_LINE][0] == steps[1:]  # NaN at step 10 is left out
    one_stage = StageHistory()
    one_stage.add({"memory/pp_stage_0/a": 1.0, "memory/a": 1.0}, 1)
    assert one_stage.charts == {}


def log_through_the_fanout(folder):
    """STAGE_STEPS through the writers (thread mode) on ``folder``: (stats, every warning's text)."""
    from nemo_memlog.writers import build_writers

    with said(warned=False) as notices:
        writers = build_writers(LoggerConfig(tensorboard_dir=str(folder), writer_mode="thread"))
        for step, metrics in STAGE_STEPS.items():
            writers.log(metrics, step)
        writers.close()
        stats = writers.stats()
    return stats, notices


def check_main_run_whole(runs, stats, messages):
    """Every step once, every key of every step, and nothing said lost."""
    assert stats["tensorboard"] == {"written": 4, "pending": 0, "dropped": 0, "failures": 0}, stats
    for tag in STAGE_STEPS[5]:
        assert [step for step, _ in runs["."][tag]] == sorted(STAGE_STEPS), tag
    assert not [m for m in messages if "did not store" in m], messages


def _a_file(path):
    path.write_text("the user's own notes\n")


def _a_dangling_link(path):
    path.symlink_to(path.parent / "nowhere" / "at all")


def _a_foreign_folder(path):
    path.mkdir()
    (path / "checkpoint.pt").write_text("not ours")


@pytest.mark.parametrize("make", [_a_file, _a_dangling_link, _a_foreign_folder])
def test_a_name_clash_leaves_the_main_run_whole_and_the_stage_run_goes_to_a_free_name(tmp_path, make):
    folder = tmp_path / "tb"
    folder.mkdir()
    make(folder / "pp_stage_0")
    stats, messages = log_through_the_fanout(folder)
    runs = tensorboard_runs(folder)
    check_main_run_whole(runs, stats, messages)
    assert set(runs) == {".", "pp_stage_0-2", "pp_stage_1", "pp_stage_2"}, sorted(runs)
    for tag in STAGE_TAGS:  # stage 0's own series, under its other name
        assert runs["pp_stage_0-2"][tag] == [(step, f32(stage_value(step, 0, tag))) for step in sorted(STAGE_STEPS)]
    clash = [m for m in messages if "pp_stage_0" in m]
    assert len(clash) == 1 and "pp_stage_0-2" in clash[0] and "is taken" in clash[0], messages
    assert os.path.lexists(folder / "pp_stage_0")  # the user's thing is left as it was
    if make is _a_file:
        assert (folder / "pp_stage_0").read_text() == "the user's own notes\n"
    if make is _a_foreign_folder:
        assert os.listdir(folder / "pp_stage_0") == ["checkpoint.pt"]


def test_an_earlier_runs_stage_folder_is_reused_and_so_is_its_other_name(tmp_path):
    folder = tmp_path / "tb"
    folder.mkdir()
    _a_file(folder / "pp_stage_0")
    log_through_the_fanout(folder)
    stats, messages = log_through_the_fanout(folder)  # the same folder again: a resumed job
    runs = tensorboard_runs(folder)
    assert set(runs) == {".", "pp_stage_0-2", "pp_stage_1", "pp_stage_2"}, sorted(runs)
    assert len(runs["pp_stage_1"]["memory/peak_reserved_gb"]) == 2 * len(STAGE_STEPS)  # appended to
    assert len(runs["pp_stage_0-2"]["memory/peak_reserved_gb"]) == 2 * len(STAGE_STEPS)


def test_every_name_taken_skips_that_stage_run_said_once_and_the_main_run_is_whole(tmp_path):
    folder = tmp_path / "tb"
    folder.mkdir()
    for name in tensorboard.stage_folder_names("pp_stage_1"):
        _a_dangling_link(folder / name)
    stats, messages = log_through_the_fanout(folder)
    runs = tensorboard_runs(folder)
    check_main_run_whole(runs, stats, messages)
    assert set(runs) == {".", "pp_stage_0", "pp_stage_2"}, sorted(runs)
    skipped = [m for m in messages if "pp_stage_1" in m]
    assert len(skipped) == 1 and "gets no run of its own" in skipped[0] and "dangling link" in skipped[0], messages


@pytest.mark.processes  # mount
def test_a_read_only_folder_of_that_name_sends_the_stage_run_to_a_free_name(tmp_path):
    from nemo_memlog.testing.mounts import read_only

    folder = tmp_path / "tb"
    with read_only(folder / "pp_stage_2"):  # empty, so free for a run, but it cannot be opened
        stats, messages = log_through_the_fanout(folder)
    runs = tensorboard_runs(folder)
    check_main_run_whole(runs, stats, messages)
    assert set(runs) == {".", "pp_stage_0", "pp_stage_1", "pp_stage_2-2"}, sorted(runs)
    clash = [m for m in messages if "pp_stage_2" in m]
    assert len(clash) == 1 and "Read-only file system" in clash[0], messages


def test_a_stage_run_failing_for_good_is_closed_said_once_and_never_retries_the_main_run(tmp_path):
    backend = tensorboard.open_backend(LoggerConfig(tensorboard_dir=str(tmp_path / "tb")), {}, [])
    steps = sorted(STAGE_STEPS)
    backend.log(STAGE_STEPS[steps[0]], steps[0])
    stage_run = backend.stage_writers["pp_stage_1"]

    def fail(*args, **kwargs):  # what a file where its folder was makes TensorBoard's writer raise
        raise FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "tb" / "pp_stage_1"))

    stage_run.add_scalar = fail  # a permanent OS error after the run opened: no real way to provoke it
    with said(warned=False) as notices:
        for step in steps[1:]:
            backend.log(STAGE_STEPS[step], step)  # never raises: the fan-out would retry the main run
        backend.close()
    failed = [m for m in notices if "pp_stage_1" in m]
    assert len(failed) == 1 and "closed for good" in failed[0], notices
    assert backend.stage_writers["pp_stage_1"] is None
    runs = tensorboard_runs(tmp_path / "tb")
    assert [step for step, _ in runs["."]["memory/peak_reserved_gb"]] == steps
    assert [step for step, _ in runs["pp_stage_1"]["memory/peak_reserved_gb"]] == steps[:1]
    assert [step for step, _ in runs["pp_stage_2"]["memory/peak_reserved_gb"]] == steps


def test_a_file_as_the_tensorboard_dir_stops_the_backend_once_instead_of_retrying_forever(tmp_path):
    _a_file(tmp_path / "tb")
    stats, messages = log_through_the_fanout(tmp_path / "tb")
    assert stats["tensorboard"]["failures"] == 1 and stats["tensorboard"]["dropped"] == 4, stats
    stopped = [m for m in messages if "this backend stops" in m]
    assert len(stopped) == 1 and "File exists" in stopped[0], messages
