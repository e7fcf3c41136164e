"""End to end: ``python scripts/demo.py ...`` run exactly as a user would (it re-launches
itself under torchrun, 4 gloo processes, PP 4), then its TensorBoard events read back.

Smaller than the default job so it takes seconds, not a minute, with interval peaks
(``logger.memory_peak_window=interval``; the default, "run", is the demo of test_sigterm.py),
and TensorBoard is the only backend: the others add time, and their memory on the writer rank (the last stage)
would need bigger activations to stay below the first stage's. Each backend's own handling
(secrets included) is tested in tests/writers/, all four under the demo in test_sigterm.py.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
ITERS, INTERVAL, STAGES, VOCAB = 5, 2, 4, 128
LOGGED_STEPS = [2, 4]  # iteration % INTERVAL == 0, iterations counted from 1
PEAK = "peak_host_rss_gb"
SECRET = "SECRET-DEMO-KEY"


def run_demo(*overrides, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    result = run_demo(
        f"run.root={root}", "run.name=test", f"train.iters={ITERS}", f"logger.tensorboard_log_interval={INTERVAL}",
        "train.micro_batch_size=32", f"model.vocab={VOCAB}", "logger.memory_peak_window=interval",
        "logger.wandb_project=null", "logger.mlflow_experiment=null", "logger.comet_project=null",
        f"logger.comet_api_key={SECRET}",  # recorded with the run config: must come out redacted
    )
    assert result.returncode == 0, f"demo failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    accumulator = EventAccumulator(str(root / "test" / "tensorboard"))
    accumulator.Reload()
    scalars = {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
               for tag in accumulator.Tags()["scalars"]}
    return result, root / "test", scalars


def test_memory_and_caller_metrics_logged_at_exactly_the_logging_steps(demo):
    _, _, scalars = demo
    memory_tags = [tag for tag in scalars if tag.startswith("memory/")]
    assert f"memory/{PEAK}" in memory_tags
    for tag in memory_tags + ["loss", "lr"]:
        assert sorted(scalars[tag]) == LOGGED_STEPS, tag


def test_pipeline_peak_is_the_max_of_the_stage_peaks(demo):
    _, _, scalars = demo
    for step in LOGGED_STEPS:
        stages = [scalars[f"memory/pp_stage_{i}/{PEAK}"][step] for i in range(STAGES)]
        assert scalars[f"memory/{PEAK}"][step] == pytest.approx(max(stages), rel=1e-6)
        assert scalars[f"memory/peak_stage/{PEAK}"][step] == stages.index(max(stages))


def test_first_stage_holds_more_than_the_last(demo):
    # 1F1B: the first stage keeps 4 microbatches' activations alive, the last stage 1.
    _, _, scalars = demo
    step = LOGGED_STEPS[-1]
    assert scalars[f"memory/pp_stage_0/{PEAK}"][step] > scalars[f"memory/pp_stage_{STAGES - 1}/{PEAK}"][step]


def test_loss_falls_below_chance(demo):
    _, _, scalars = demo
    assert scalars["loss"][LOGGED_STEPS[-1]] < math.log(VOCAB)


def test_the_table_and_the_dashboard_command_are_printed(demo):
    result, _, scalars = demo
    stdout = result.stdout
    step = LOGGED_STEPS[-1]
    assert f"Peak host RSS per pipeline stage at iteration {step} (since the previous logging step)" in stdout
    for stage in range(STAGES):
        assert f"{scalars[f'memory/pp_stage_{stage}/{PEAK}'][step]:.3f} GB" in stdout
    assert f"memory/{PEAK} = {scalars[f'memory/{PEAK}'][step]:.3f} GB" in stdout
    assert "tensorboard --logdir " in stdout


def test_the_report_names_the_interval_window_recorded_with_the_run_config(demo, capsys):
    from nemo_memlog.cli import main

    _, run, _ = demo
    assert main(["report", str(run), "--png", str(run / "report.png")]) == 0
    assert "peak window: interval" in capsys.readouterr().out
    assert b"peak window: interval" in (run / "report.png").read_bytes()


def test_an_unknown_override_is_refused_before_any_process_starts(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # main() sets these defaults: keep them out of this process
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("RANK", raising=False)
    import demo as demo_script

    monkeypatch.setattr(demo_script, "relaunch", lambda overrides: pytest.fail("launched despite a bad override"))
    assert demo_script.main(["train.iterz=3"]) == 2
    assert "'iterz' not in 'TrainConfig'" in capsys.readouterr().err

def test_a_secret_on_the_command_line_is_written_nowhere(demo):
    result, run, _ = demo
    written = [path for path in run.rglob("*") if path.is_file()]
    assert written, "the run wrote nothing"
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in result.stdout + result.stderr
