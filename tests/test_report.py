"""`nemo-memlog report` on a run directory written with the library's tag layout."""

import contextlib
import io
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_memlog.cli import main
from tests.readback import png_size

STEPS = list(range(0, 80, 10))  # 8 logged steps, written by two writer sessions (a resume)
DEVICE_TOTAL, HOST_TOTAL = 80.0, 512.0


def reserved(stage, k):
    """Stage 1 holds the most; its peak (38.5 GB at step 40) is above its latest value."""
    base = [20.0, 31.0, 24.0, 12.0][stage] + 0.5 * min(k, 3)
    return 38.5 if (stage, k) == (1, 4) else base


def allocated(stage, k):
    return reserved(stage, k) - 2.0


def host_rss(stage, k):
    """Stage 2's node holds the most host memory."""
    return [10.0, 12.0, 14.0, 10.5][stage] + 0.25 * k


def step_metrics(k, stages=4):
    metrics = {"loss": 3.0 - 0.1 * k, "lr": 1e-4}
    per_stage = {"peak_reserved_gb": reserved, "peak_allocated_gb": allocated, "peak_host_rss_gb": host_rss}
    for name, value in per_stage.items():
        values = [value(s, k) for s in range(stages)]
        metrics[f"memory/{name}"] = max(values)
        metrics[f"memory/peak_stage/{name}"] = values.index(max(values))
        for stage, v in enumerate(values):
            metrics[f"memory/pp_stage_{stage}/{name}"] = v
    retries = [0, k // 2, 0, 0]  # a counter, not logged per stage
    metrics["memory/alloc_retries"] = max(retries)
    metrics["memory/peak_stage/alloc_retries"] = retries.index(max(retries))
    metrics.update({"memory/device_total_gb": DEVICE_TOTAL, "memory/host_total_gb": HOST_TOTAL})
    headroom = min((DEVICE_TOTAL - reserved(s, k), s) for s in range(stages))
    metrics.update({"memory/headroom_gb": headroom[0], "memory/headroom_stage": headroom[1]})
    host_headroom = min((HOST_TOTAL - 3 * host_rss(s, k), s) for s in range(stages))
    metrics.update({"memory/host_headroom_gb": host_headroom[0], "memory/host_headroom_stage": host_headroom[1]})
    return metrics


def write_events(tensorboard_dir, steps, **add_scalar):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tensorboard_dir))
    for step in steps:
        for tag, value in step_metrics(step // 10).items():
            writer.add_scalar(tag, value, step, **add_scalar)
    writer.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "demo"
    write_events(run / "tensorboard", STEPS[:4])
    write_events(run / "tensorboard", STEPS[4:])  # a resumed job: a second event file
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2
    return run


@pytest.fixture(scope="module")
def report(run_dir):
    """(exit code, stdout) of one `report` call; the PNG lands in run_dir."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["report", str(run_dir)])
    print(out.getvalue())  # shown with pytest -s
    return code, out.getvalue()


def row(stdout, metric):
    """The cells of the metric's row (wrapped blocks joined); a size keeps its unit: "32.50 GB"."""
    lines = [line for line in stdout.splitlines() if line.split() and line.split()[0] == metric]
    cells = [re.findall(r"-?[\d.]+ [GM]B|\S+", line) for line in lines]
    return cells[0] + [cell for more in cells[1:] for cell in more[1:]]


def test_table_names_the_stage_holding_the_max(report):
    code, stdout = report
    assert code == 0
    assert "steps 0..70 (8 logged); pipeline stages: 4" in stdout
    # metric | logged now, peak, stage | stage 0..3 now, peak | headroom GB, stage
    assert row(stdout, "peak_reserved_gb") == [
        "peak_reserved_gb",
        "32.50 GB",
        "38.50 GB",
        "1",
        "21.50 GB",
        "21.50 GB",
        "32.50 GB",
        "38.50 GB",
        "25.50 GB",
        "25.50 GB",
        "13.50 GB",
        "13.50 GB",
        "47.50 GB",
        "1",
    ]
    assert row(stdout, "peak_allocated_gb")[1:4] == ["30.50 GB", "36.50 GB", "1"]
    assert row(stdout, "peak_host_rss_gb")[1:6] == ["15.75 GB", "15.75 GB", "2", "11.75 GB", "11.75 GB"]
    assert row(stdout, "peak_host_rss_gb")[-2:] == ["464.75 GB", "2"]  # host headroom on host rows
    assert row(stdout, "alloc_retries") == ["alloc_retries", "3", "3", "1", *["-"] * 8, "47.50 GB", "1"]
    assert "loss" not in stdout and "lr" not in stdout.split()
    assert max(len(line) for line in stdout.splitlines() if not line.startswith(("run:", "plot"))) <= 120


def test_png_is_written_and_named(report, run_dir):
    _, stdout = report
    png = run_dir / "memory_report.png"
    assert stdout.rstrip().endswith(str(png))
    (width, height), size = png_size(png)
    assert width >= 400 and height >= 300 and size > 10_000


def test_png_path_and_metric_options(run_dir, tmp_path, capsys):
    png = tmp_path / "plots" / "host.png"
    assert main(["report", str(run_dir / "tensorboard"), "--png", str(png), "--metric", "memory/peak_host_rss_gb"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(str(png))
    assert png_size(png)[1] > 10_000
    assert main(["report", str(run_dir), "--png", str(png), "--metric", "nope"]) == 2
    assert "no metric 'nope'; available: peak_allocated_gb" in capsys.readouterr().err


@pytest.mark.parametrize("make", [lambda p: p.mkdir(), lambda p: None], ids=["empty", "missing"])
def test_unreadable_directory_is_a_clear_error(tmp_path, capsys, make):
    run = tmp_path / "run"
    make(run)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(run) in err
    assert "events.out.tfevents.*" in err and "logger.tensorboard_dir" in err


def test_new_style_scalars_are_read(tmp_path, capsys):
    write_events(tmp_path / "tb", STEPS[:2], new_style=True)
    assert main(["report", str(tmp_path), "--png", str(tmp_path / "p.png")]) == 0
    assert row(capsys.readouterr().out, "peak_reserved_gb")[1:4] == ["31.50 GB", "31.50 GB", "1"]


def test_cli_does_not_import_torch_itself():
    """The command line, the offline commands (report, postmortem, advise, their renderers and plots)
    and the launchers (run, fit) name no torch in their source (the import graph: `make lint`)."""
    package = Path(__file__).parents[1] / "nemo_memlog"
    modules = sorted([package / "cli.py", *(package / "offline").rglob("*.py"), *(package / "launch").rglob("*.py")])
    names = {str(module.relative_to(package)) for module in modules}
    assert {"cli.py", "offline/report/__init__.py", "offline/report/plot.py", "launch/fit/probe.py"} <= names
    for module in modules:
        source = module.read_text()
        assert "import torch" not in source and "from torch" not in source, module


@pytest.mark.processes
def test_console_script(run_dir, tmp_path):
    script = Path(sys.executable).parent / "nemo-memlog"
    done = subprocess.run(
        [str(script), "report", str(run_dir), "--png", str(tmp_path / "r.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "peak_reserved_gb" in done.stdout and (tmp_path / "r.png").is_file()


def test_without_a_recorded_config_the_window_is_said_to_be_unknown(report):
    assert "peak window: not recorded" in report[1]


def write_with_config(tensorboard_dir, steps, params):
    """Events as the TensorBoard writer leaves them: the run config as text, then the steps."""
    from nemo_memlog.config import LoggerConfig
    from nemo_memlog.writers import tensorboard

    backend = tensorboard.open_backend(LoggerConfig(tensorboard_dir=str(tensorboard_dir)), params, [])
    for step in steps:
        backend.log(step_metrics(step // 10), step)
    backend.close()


@pytest.mark.parametrize(
    "recorded, label",
    [
        (
            [{"memory_peak_window": "interval"}],
            "peak window: interval (each peak_* point is the peak since the previous logged step)",
        ),
        (
            [{"logger.memory_peak_window": "run"}],
            "peak window: run (each peak_* point is the peak since its process started)",
        ),
        ([{"tensorboard_dir": "x"}], "peak window: run"),  # recorded before the option existed
        ([{"memory_peak_window": "run"}, {"memory_peak_window": "interval"}], "peak window: run -> interval"),
    ],
    ids=["interval", "run", "before-the-option", "resumed-with-another"],
)
def test_table_and_png_name_the_peak_window(tmp_path, capsys, recorded, label):
    for index, params in enumerate(recorded):
        write_with_config(tmp_path / "tb", STEPS[2 * index : 2 * index + 2], params)
    png = tmp_path / "p.png"
    assert main(["report", str(tmp_path), "--png", str(png)]) == 0
    assert label in capsys.readouterr().out
    assert f"peak_reserved_gb per pipeline stage, {label.split(' (')[0]}".encode() in png.read_bytes()


def test_a_resume_is_named_with_the_step_it_continues_at(report):
    _, stdout = report  # the fixture's second event file starts at step 40, after the run's first
    assert "resumed at step 40 (event file events.out.tfevents." in stdout and "NOTE" not in stdout


def test_a_second_run_that_starts_over_in_the_same_folder_is_not_stitched(tmp_path, capsys):
    # A job re-run into the same folder with fewer steps: its steps start over at 0. The old
    # run's later steps must not be appended to it, nor the two called a resume.
    folder = tmp_path / "tensorboard"
    started = time.time()
    write_events(folder, STEPS, walltime=started - 3600)  # the first run, an hour earlier: steps 0..70
    (old,) = folder.glob("events.out.tfevents.*")
    write_events(folder, STEPS[:3], walltime=started)  # the second run: steps 0..20
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "steps 0..20 (3 logged)" in out and "resumed" not in out
    assert f"NOTE: {tmp_path} holds 2 runs" in out and "steps 0..70, started " in out and str(old) in out
    assert main(["report", str(old)]) == 0  # the other one, by its event file
    assert "steps 0..70 (8 logged)" in capsys.readouterr().out


def test_png_marks_the_last_stage_as_stock_dashboards_and_labels_the_gap(report, run_dir):
    """The gap the PNG labels: at the last step, the peak over stages minus the last stage's value
    (what stock Megatron dashboards, written by the last rank, show); the Title names the folder."""
    from nemo_memlog.offline.events import load_run
    from nemo_memlog.offline.report.plot import gap_to_last_stage

    run = load_run(run_dir)
    k = STEPS[-1] // 10
    step, peak, shown, stage = gap_to_last_stage(run.per_stage("peak_reserved_gb"), 3)
    assert (step, stage) == (STEPS[-1], 1)
    assert (peak, shown) == (pytest.approx(reserved(1, k)), pytest.approx(reserved(3, k)))
    assert b"demo: peak_reserved_gb per pipeline stage" in (run_dir / "memory_report.png").read_bytes()


def write_composition(tensorboard_dir, activations_gb, steps=(0, 10)):
    """Per-stage composition scalars as a CPU run logs them: no temporaries, slack or device_other."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tensorboard_dir))
    for step in steps:
        for stage, activations in enumerate(activations_gb):
            values = {
                "params_gb": 0.002,
                "grads_gb": 0.002,
                "optimizer_state_gb": 0.004,
                "model_state_gb": 0.008,
                "activations_gb": activations,
                "microbatches_in_flight": len(activations_gb) - stage,
            }
            for name, value in values.items():
                writer.add_scalar(f"memory/pp_stage_{stage}/{name}", value, step)
    writer.close()


@pytest.mark.parametrize("activations_gb, unit", [((0.54, 0.41, 0.27, 0.14), "MB"), ((5.4, 4.1, 2.7, 1.4), "GB")])
def test_composition_png_picks_its_unit_and_names_the_microbatches_in_flight(tmp_path, capsys, activations_gb, unit):
    from nemo_memlog.offline.events import load_run
    from nemo_memlog.offline.report import composition as composition_plot

    write_composition(tmp_path / "tb", activations_gb)
    run = load_run(tmp_path)
    step, parts = composition_plot.stage_parts(run)
    assert step == 10 and parts[2]["activations_gb"] == pytest.approx(activations_gb[2])
    assert composition_plot.unit(parts) == (unit, 1000.0 if unit == "MB" else 1.0)
    labels = composition_plot.in_flight_labels(run, step)
    assert labels == {0: "4 in flight", 1: "3 in flight", 2: "2 in flight", 3: "1 in flight"}
    assert main(["report", str(tmp_path)]) == 0
    png = tmp_path / "memory_report_composition.png"
    assert f"what each stage's memory is made of: {png}" in capsys.readouterr().out
    assert png_size(png)[1] > 10_000


# ---- issue 40: units, names, capacity, replica, pictures ---------------------------------


@pytest.mark.parametrize(
    "gb, text",
    [
        (1.8412, "1.84 GB"),
        (25.276, "25.28 GB"),
        (0.543, "543 MB"),
        (0.0084, "8.4 MB"),
        (0.00047, "0.47 MB"),
        (0.9996, "1.00 GB"),  # never "1000 MB"
        (0.0, "0 MB"),
        (-0.5, "-500 MB"),
        (None, "-"),
        (float("nan"), "-"),
    ],
)
def test_the_units_rule(gb, text):
    """One rule for every size in report, advise, postmortem and their PNGs: MB below 1 GB, GB above;
    a part below 10 MB keeps two significant digits, never rounded away to "0.01" or "0.00"."""
    from nemo_memlog.advice import fmt
    from nemo_memlog.offline.tables import gb_cell, metric_cell, size_text

    assert size_text(gb) == text
    assert fmt(gb) == text and gb_cell(gb) == text
    if gb is not None:
        assert metric_cell("params_gb", gb) == text


def cpu_run(folder, with_records=True, rss=(1.84, 1.61, 1.35, 1.04), wobble=0.0):
    """A CPU run as the demo leaves it: per-stage composition and peak host RSS in the events, the
    node's 25.28 GB shared by its 4 ranks, and (``with_records``) the per-layer records advise reads."""
    import json

    from torch.utils.tensorboard import SummaryWriter

    activations = (0.81, 0.61, 0.40, 0.22)
    writer = SummaryWriter(log_dir=str(folder / "tensorboard"))
    for step in (1, 2, 3, 4):
        values = {"memory/host_total_gb": 25.28, "memory/peak_host_rss_gb": max(rss) + wobble * (step % 2)}
        for stage in range(4):
            stage_values = {
                "params_gb": 0.00047,
                "grads_gb": 0.00047,
                "optimizer_state_gb": 0.00093,
                "model_state_gb": 0.0019,
                "activations_gb": activations[stage],
                "microbatches_in_flight": 4 - stage,
                "peak_host_rss_gb": rss[stage] + wobble * (step % 2),
            }
            values.update({f"memory/pp_stage_{stage}/{name}": value for name, value in stage_values.items()})
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
    writer.close()
    if not with_records:
        return folder
    records = folder / "memory_records"
    records.mkdir()
    for stage in range(4):
        record = {
            "format": "nemo_memlog.layers",
            "version": 1,
            "rank": stage,
            "world_size": 4,
            "local_world_size": 4,
            "pp_rank": stage,
            "pp_size": 4,
            "tp_rank": 0,
            "tp_size": 1,
            "dp_rank": 0,
            "dp_size": 1,
            "iteration": 4,
            "time": 1.0,
            "run": {"micro_batch_size": 2, "microbatches": 4},
            "stage": {
                "params_gb": 0.00047,
                "grads_gb": 0.00047,
                "optimizer_state_gb": 0.00093,
                "model_state_gb": 0.0019,
                "activations_gb": activations[stage],
                "activations_per_microbatch_gb": activations[stage] / (4 - stage),
                "microbatches_in_flight": 4 - stage,
                "peak_host_rss_gb": rss[stage],
                "host_total_gb": 25.28,
            },
            "layers": [],
        }
        (records / f"rank-{stage:05d}.layers.json").write_text(json.dumps(record))
    return folder


def captured(monkeypatch, module):
    """The figures ``module.write_png`` draws, kept instead of only saved."""
    figures = []
    real = module.save

    def keep(figure, path, title):
        figures.append(figure)
        return real(figure, path, title)

    monkeypatch.setattr(module, "save", keep)
    return figures


def legend_texts(figure) -> list[str]:
    return [text.get_text() for axes in figure.axes if axes.get_legend() for text in axes.get_legend().get_texts()]


def all_texts(figure) -> str:
    titles = [axes.get_title(loc) for axes in figure.axes for loc in ("left", "center", "right")]
    texts = [t.get_text() for axes in figure.axes for t in axes.texts] + titles + legend_texts(figure)
    return "\n".join(texts + ([figure._suptitle.get_text()] if figure._suptitle else []))


def test_report_and_advise_give_the_same_capacity_and_say_where_it_came_from(tmp_path, capsys):
    run = cpu_run(tmp_path / "run")
    assert main(["report", str(run), "--png", str(tmp_path / "r.png")]) == 0
    report = capsys.readouterr().out
    assert main(["advise", str(run), "--no-png"]) == 0
    advise = capsys.readouterr().out
    said = "capacity per rank: 6.32 GB (host memory 25.28 GB, shared by 4 ranks on this node)"
    assert said in report and said in advise
    assert report.count("capacity per rank:") == 1
    # the headroom figures agree too: the least, stage 0's, is 6.32 - 1.84
    assert "least headroom per rank: 4.48 GB on stage 0" in report
    assert "4.48 GB" in [
        cell for line in advise.splitlines() if line.startswith("headroom") for cell in [line[24:46].strip()]
    ]
    assert main(["advise", str(run), "--json", "--no-png"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["capacity_gb"] == pytest.approx(25.28 / 4)


def test_without_records_the_report_says_why_its_capacity_is_not_per_rank(tmp_path, capsys):
    run = cpu_run(tmp_path / "run", with_records=False)
    assert main(["report", str(run), "--png", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "host memory: 25.28 GB on this node, shared by its ranks" in out and "capacity per rank" not in out


def test_records_kept_apart_are_read_with_records_and_an_unreadable_folder_is_named(tmp_path, capsys):
    run = cpu_run(tmp_path / "run")
    apart = (run / "memory_records").rename(tmp_path / "kept_apart")  # memory_record_dir set elsewhere
    assert main(["report", str(run), "--png", str(tmp_path / "a.png")]) == 0
    assert "capacity per rank" not in capsys.readouterr().out  # not found beside the events
    assert main(["report", str(run), "--records", str(apart), "--png", str(tmp_path / "b.png")]) == 0
    assert "capacity per rank: 6.32 GB" in capsys.readouterr().out  # the node's 25.28 GB over its 4 ranks
    (tmp_path / "empty").mkdir()
    assert main(["report", str(run), "--records", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert f"--records {tmp_path / 'empty'}: no per-layer records" in err, err


def test_one_name_per_part_in_the_tables_and_the_pictures(tmp_path, capsys, monkeypatch):
    from nemo_memlog.offline.advise import plot as advise_plot
    from nemo_memlog.offline.report import composition as composition_plot

    run = cpu_run(tmp_path / "run")
    advise_figures = captured(monkeypatch, advise_plot)
    composition_figures = captured(monkeypatch, composition_plot)
    assert main(["advise", str(run), "--what-if", "micro_batch_size=x2"]) == 0
    text = capsys.readouterr().out
    assert main(["report", str(run)]) == 0
    capsys.readouterr()
    assert any(line.startswith("rest of the process") for line in text.splitlines())
    assert "params" not in text and "parameters" in text and "0.47 MB -> 0.47 MB" in text
    advise_legend = legend_texts(advise_figures[-1])
    composition_legend = legend_texts(composition_figures[-1])
    for legend in (advise_legend, composition_legend):
        assert "rest of the process" in legend and "parameters" in legend
        assert not any("outside the parts above" in entry for entry in legend)
        assert any(
            entry.startswith("capacity per rank 6.32 GB") or entry.startswith("capacity per rank: 6.32 GB")
            for entry in legend
        ), legend


def test_the_composition_bars_reach_the_measured_peak_against_the_capacity(tmp_path, capsys, monkeypatch):
    from nemo_memlog.offline.report import composition as composition_plot

    run = cpu_run(tmp_path / "run")
    figures = captured(monkeypatch, composition_plot)
    assert main(["report", str(run)]) == 0
    capsys.readouterr()
    [axes] = figures[-1].axes
    labels = [text.get_text() for text in axes.texts]
    assert labels == ["1.84 GB", "1.61 GB", "1.35 GB", "1.04 GB"]  # the peak host RSS, not 810 MB of activations
    capacity = [line for line in axes.get_lines() if line.get_label().startswith("capacity per rank")]
    assert capacity and capacity[0].get_ydata()[0] == pytest.approx(6.32)
    assert "the only data-parallel replica (DP 1)" in figures[-1]._suptitle.get_text()


def test_report_png_labels_a_gap_only_beyond_the_runs_own_variation(tmp_path, capsys, monkeypatch):
    from nemo_memlog.offline.report import plot as report_plot

    figures = captured(monkeypatch, report_plot)
    apart = cpu_run(tmp_path / "apart")
    level = cpu_run(tmp_path / "level", rss=(1.049, 1.045, 1.043, 1.040), wobble=0.03)
    assert main(["report", str(apart), "--metric", "peak_host_rss_gb"]) == 0
    assert main(["report", str(level), "--metric", "peak_host_rss_gb"]) == 0
    capsys.readouterr()
    apart_text, level_text = all_texts(figures[0]), all_texts(figures[1])
    assert "+800 MB (+77%) on stage 0" in apart_text and "stages vary by at most" in apart_text
    assert "+9 MB" not in level_text.replace("(9 MB)", "") and "hidden from last-rank" not in level_text
    assert "stages level: the gap (9 MB) is within what a stage varies over the run (30 MB)" in level_text
    for figure in figures:  # a capacity off the scale is a note, never a legend entry for a line not drawn
        assert not any("above this scale" in entry or "host_total_gb" in entry for entry in legend_texts(figure))
        assert "per-stage values: the only data-parallel replica (DP 1)" in figure._suptitle.get_text()
        [axes] = figure.axes  # the words sit above the axes, the legend beside them: none over the lines
        assert [text.get_text() for text in axes.texts if text.get_text()] == []
        assert axes.get_ylabel() in ("peak_host_rss (GB)", "peak_host_rss (MB)")  # its unit once


def test_advise_names_the_stage_that_would_hold_the_peak(tmp_path, capsys):
    from nemo_memlog import advice
    from nemo_memlog.offline.advise import peak_line

    def outcome(stage, now, predicted):
        return advice.Outcome(stage, {"activations_gb": now}, {"activations_gb": predicted}, 1, 1, 10.0)

    assert peak_line([outcome(0, 1.84, 1.84), outcome(1, 1.61, 2.2)]) == (
        "peak: moves from stage 0 today (1.84 GB) to stage 1 predicted (2.20 GB)"
    )
    assert peak_line([outcome(0, 1.84, 1.9), outcome(1, 0.5, 0.6)]).startswith("peak: stage 0 holds it today")
