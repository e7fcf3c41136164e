"""W&B writer: one real offline run, read back in process and from the run directory.

The secret is both in the config and on the command line (``sys.argv``), where W&B's
metadata capture would record it if it were on.
"""

import json
import math
import os
import sys

import pytest

from nemo_memlog.config import REDACTED, LoggerConfig, flat_params, secrets_of
from nemo_memlog.testing.wait import wait_for
from nemo_memlog.writers import wandb as wandb_writer
from tests.readback import wandb_records
from tests.writers.sample import LACKING_FIELDS, SECRET, STEPS, write_steps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    cfg = LoggerConfig(
        wandb_project="memlog-test", wandb_exp_name="pp-run", wandb_save_dir=str(root / "runs"), comet_api_key=SECRET
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        # Everything else wandb writes lands under root too, so the secret scan sees it all.
        for name in ("XDG_CACHE_HOME", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            env.setenv(name, str(root / name.lower()))
        env.setattr(sys, "argv", ["pretrain.py", f"logger.comet_api_key={SECRET}", "logger.wandb_project=x"])
        backend = wandb_writer.open_backend(cfg, flat_params(cfg), secrets_of(cfg))
        write_steps(backend)
        seen = {"summary": dict(backend.run.summary), "config": dict(backend.run.config), "dir": backend.run.dir}
        backend.close()
    return root, seen


def test_enabled_only_with_a_project():
    assert wandb_writer.enabled(LoggerConfig(wandb_project="p"))
    assert not wandb_writer.enabled(LoggerConfig())
    assert not wandb_writer.enabled(LACKING_FIELDS)


@pytest.mark.processes
def test_summary_keeps_ints_and_non_finite_values(run):
    _, seen = run
    summary = seen["summary"]
    assert summary["memory/alloc_retries"] == 8 and type(summary["memory/alloc_retries"]) is int
    assert summary["memory/peak_allocated_gb"] == 4.0 and summary["memory/weird key*(1)"] == 0.25
    assert math.isnan(summary["memory/nan_gb"])
    assert summary["memory/inf_gb"] == math.inf and summary["memory/neg_inf_gb"] == -math.inf


@pytest.mark.processes
def test_config_is_the_redacted_params(run):
    _, seen = run
    assert seen["config"]["comet_api_key"] == REDACTED
    assert seen["config"]["wandb_project"] == "memlog-test"


@pytest.mark.processes
def test_history_on_disk_has_every_metric_at_its_step(run):
    root, _ = run
    (log,) = (root / "runs" / "wandb").glob("offline-run-*/run-*.wandb")

    # W&B's service process appends to the run file on its own; on a loaded machine the last
    # records can land a moment after finish() returned: wait for them (bounded), never sleep blind.
    def both_steps() -> dict:
        history = {}
        for record in wandb_records(log):
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                history[int(items["_step"])] = items
        return history if sorted(history) == [10, 20] else {}

    history = wait_for(both_steps, 30, "W&B's history records of steps 10 and 20", interval_s=0.2)
    for step, metrics in STEPS.items():
        for key, value in metrics.items():
            stored = json.loads(history[step][key])  # Python's json reads NaN and Infinity too
            assert stored == value or math.isnan(value) and math.isnan(stored), (step, key)
    assert history[10]["memory/alloc_retries"] == "7"  # an int, not "7.0"
    assert history[20]["memory/peak_allocated_gb"] == "4"  # W&B writes integral floats without ".0"
    (run_record,) = [r.run for r in wandb_records(log) if r.WhichOneof("record_type") == "run"]
    assert run_record.display_name == "pp-run" and run_record.project == "memlog-test"


@pytest.mark.processes
def test_no_environment_capture_and_no_secret_anywhere(run):
    root, seen = run
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    assert [p for p in files if SECRET.encode() in p.read_bytes()] == []
    # Metadata (argv), console output, requirements: none written.
    names = {p.name for p in files}
    assert not names & {"wandb-metadata.json", "output.log", "requirements.txt"}


EXITS_WITHOUT_CLOSE = """
import os, sys
from nemo_memlog import LoggerConfig, build_writers
cfg = LoggerConfig(log_memory_to_tensorboard=True, writer_mode="thread", wandb_project="p", wandb_save_dir=sys.argv[1])
writers = build_writers(cfg)
writers.log({"memory/peak_host_rss_gb": 1.0}, 1)
assert writers.flush(120), writers.stats()  # W&B's run started: its library has registered its exit hooks
for step in range(2, 302):
    writers.log({"memory/peak_host_rss_gb": float(step)}, step)
print("pending", writers.stats()["wandb"]["pending"], flush=True)
sys.exit(0)  # no close: the interpreter's exit closes the writers
"""


@pytest.mark.processes
def test_an_exit_without_close_in_thread_mode_writes_every_step_before_wandb_ends_its_service(tmp_path):
    """W&B registers the end of its service process at exit when a run starts, after our exit hook;
    atexit runs the last registered first, so our close used to find the service gone (ConnectionResetError:
    Connection lost) and lose every step still buffered (299 of 301 here). Our hook now runs first."""
    import subprocess

    from tests.readback import wandb_finished, wandb_steps

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, "-c", EXITS_WITHOUT_CLOSE, str(tmp_path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0, done.stdout  # steps were still buffered when the exit began
    assert wandb_steps(tmp_path) == set(range(1, 302)), done.stderr[-3000:]
    assert wandb_finished(tmp_path) and "Connection lost" not in done.stderr
