"""The main job end to end, launched as a user does, read back from its TensorBoard events."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_logs_pipeline_peak_and_prints_the_table(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "scripts/demo.py", "train.iters=4", "logger.tensorboard_log_interval=2",
         f"run.root={tmp_path}", "run.name=small", "logger.comet_api_key=SECRET-DEMO-KEY"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Peak host RSS per pipeline stage" in done.stdout and "tensorboard --logdir" in done.stdout

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (tmp_path / "small" / "tensorboard").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    scalars = {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}
    assert sorted(scalars["memory/peak_host_rss_gb"]) == [2, 4], "logged at the interval only"
    assert sorted(scalars["loss"]) == [2, 4], "the caller's loss rides in the same steps"
    for step in (2, 4):
        stages = [scalars[f"memory/pp_stage_{i}/peak_host_rss_gb"][step] for i in range(4)]
        assert scalars["memory/peak_host_rss_gb"][step] == max(stages)
        assert scalars["memory/peak_stage/peak_host_rss_gb"][step] == stages.index(max(stages))
    assert stages[0] > stages[3], "1F1B: the first stage holds the most in-flight activations"

    # A secret given on the command line appears in no file the run wrote, nor on the console.
    for path in (tmp_path / "small").rglob("*"):
        if path.is_file():
            assert b"SECRET-DEMO-KEY" not in path.read_bytes(), path
        if path.suffix == ".zip":  # the Comet archive is compressed: look inside
            with zipfile.ZipFile(path) as archive:
                assert not any(b"SECRET-DEMO-KEY" in archive.read(name) for name in archive.namelist())
    assert "SECRET-DEMO-KEY" not in done.stdout + done.stderr
