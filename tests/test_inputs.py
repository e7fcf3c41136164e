"""Bad input is refused at the call that brings it, never later in training; nothing is silent;
no secret is written (issue 39, round 3). In this process, except the secrets run (real backends)."""

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from nemo_memlog import LoggerConfig, close_writers, training_log
from nemo_memlog.measure import layer_record
from nemo_memlog.monitor import MemoryMonitor
from nemo_memlog.testing.notices import said


@pytest.fixture(autouse=True)
def _closed():
    yield
    close_writers()


def config(tmp_path=None, **settings):
    record = str(tmp_path) if tmp_path is not None else "off"
    return LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir=record, **settings)


def model_step(model):
    import torch

    model(torch.ones(2, 8)).sum().backward()


BAD_FACTS = [
    ({"micro_batch_size": "8", "microbatches": 4}, r"facts\['micro_batch_size'\] must be a positive int"),
    ({"micro_batch_size": 8.5}, r"facts\['micro_batch_size'\] must be a positive int, at most 1048576; got 8\.5"),
    ({"micro_batch_size": math.nan}, r"facts\['micro_batch_size'\] must be a positive int"),
    ({"micro_batch_size": 10**8}, r"facts\['micro_batch_size'\] must be a positive int, at most 1048576"),
    ({"microbatches": 0}, r"facts\['microbatches'\] must be a positive int"),
    ({"micro_batch_size": True}, r"facts\['micro_batch_size'\] must be a positive int"),
    ({"distributed_optimizer": "yes"}, r"facts\['distributed_optimizer'\] must be true or false"),
    ({"recompute": "partial"}, r"facts\['recompute'\] must be one of 'none', 'full', 'selective'"),
    ({"schedule": 3}, r"facts\['schedule'\] must be the pipeline schedule's name"),
    ({"microbatch_group_size_per_vp_stage": -2}, r"facts\['microbatch_group_size_per_vp_stage'\] must be a positive"),
    ({"note": {1, 2}}, r"facts\['note'\] must be a bool, a number or a string"),
    ({"note": math.inf}, r"facts\['note'\] must be a bool, a number or a string"),
    ({"note": "x" * 50_000_000}, r"facts\['note'\] must be at most 4096 bytes as JSON; got a string of 50000000"),
    ({f"fact{i}": i for i in range(65)}, r"facts= holds 65 facts; at most 64"),
    ({3: "x"}, r"facts= names must be strings"),
    ([("micro_batch_size", 8)], r"facts= must be a dict"),
]


@pytest.mark.parametrize(("facts", "message"), BAD_FACTS, ids=range(len(BAD_FACTS)))
def test_bad_facts_are_refused_at_the_first_call_that_carries_them(facts, message):
    """facts={"micro_batch_size": "8"} (or 8.5, NaN) raised a TypeError into the loop at the first measured
    logging step; 10**8 never returned; a 50 MB fact was rewritten at every logging step. Now the call
    that brings them raises, naming the fact, also off the logging iterations; nothing is recorded."""
    cfg = config(tensorboard_log_interval=10)
    with pytest.raises((TypeError, ValueError), match=message):
        training_log(1, cfg, facts=facts)  # not a logging iteration: refused anyway
    with pytest.raises((TypeError, ValueError), match=message):
        training_log(2, cfg, facts=facts)  # still refused: nothing was taken
    (monitor,) = __import__("nemo_memlog.monitor.training_log", fromlist=["open_monitors"]).open_monitors()
    assert monitor.facts == {}


def test_good_facts_are_checked_once_and_recorded_with_secrets_redacted(tmp_path):
    import torch

    secret = "COMET-KEY-facts-7"
    cfg = config(tmp_path, tensorboard_log_interval=2, comet_api_key=secret)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    facts = {
        "micro_batch_size": 2,
        "microbatches": 1,
        "distributed_optimizer": False,
        "recompute": "none",
        "schedule": "1f1b",
        "note": "a short string",
        "comet_api_key": "anything",  # a secret-named fact
        "holds_the_key": f"key={secret}",  # a fact holding the configured secret
        "unset": None,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no writer configured
        training_log(1, cfg, model=model, optimizer=optimizer, facts=facts)
        model_step(model)
        logged = training_log(2, cfg, model=model, optimizer=optimizer, facts=dict(facts))
    assert "memory/peak_host_rss_gb" in logged
    (record,) = layer_record.read_folder(tmp_path)
    run = record["run"]
    assert run["micro_batch_size"] == 2 and run["recompute"] == "none" and run["note"] == "a short string"
    assert run["comet_api_key"] == run["holds_the_key"] == "***redacted***" and "unset" not in run
    assert secret not in (tmp_path / layer_record.file_name(0)).read_text()


def test_facts_are_checked_again_only_when_they_change(monkeypatch):
    from nemo_memlog import monitor as monitor_module

    checks = []
    real = monitor_module.checked_facts
    monkeypatch.setattr(monitor_module, "checked_facts", lambda *a: checks.append(1) or real(*a))
    cfg = config(tensorboard_log_interval=2)
    facts = {"micro_batch_size": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for iteration in range(1, 9):
            training_log(iteration, cfg, facts=facts)
        assert len(checks) == 1
        facts["micro_batch_size"] = 2  # changed in place: taken at the next call
        training_log(9, cfg, facts=facts)
        assert len(checks) == 2
        with pytest.raises(ValueError, match=r"facts\['micro_batch_size'\]"):
            training_log(10, cfg, facts={"micro_batch_size": "2"})


def test_a_value_json_cannot_encode_never_drops_the_per_layer_record(tmp_path):
    """A fact JSON cannot encode (set where training_log's checks are bypassed, as an integration
    may) dropped the whole per-layer record; now it is written as its text."""
    import torch

    cfg = config(tmp_path, tensorboard_log_interval=2)
    monitor = MemoryMonitor(cfg)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    monitor.facts.update(odd={1, 2}, when=Path("/x"))
    with said() as caught:
        monitor.before_iteration(2, model)
        model_step(model)
        monitor.log(2, model=model)
    monitor.close()
    (record,) = layer_record.read_folder(tmp_path)
    assert record["run"]["odd"] == "{1, 2}" and record["run"]["when"] == "/x" and record["layers"]
    assert not [w for w in caught if "per-layer record" in w]


def test_the_iteration_and_metrics_are_checked_at_the_call():
    cfg = config(tensorboard_log_interval=2)
    with pytest.raises(TypeError, match=r"^training_log: iteration must be an int"):
        training_log("3", cfg)
    with pytest.raises(ValueError, match=r"^training_log: iteration must be an int >= 0"):
        training_log(-1, config(tensorboard_log_interval=3))
    with pytest.raises(TypeError, match=r"^metrics= must be a dict"):
        training_log(2, cfg, metrics=[("loss", 1.0)])


def test_logging_off_with_what_it_ignores_says_so_once(tmp_path):
    """log_memory_to_tensorboard off, with backends, a model and facts: nothing was written, without a word."""
    import torch

    model = torch.nn.Linear(8, 1)
    off = LoggerConfig(tensorboard_dir=str(tmp_path / "tb"), memory_record_dir=str(tmp_path / "rec"))
    with said(notices=False) as caught:
        for iteration in range(1, 5):
            assert training_log(iteration, off, model=model, facts={"micro_batch_size": 2}) is None
    off_said = [w for w in caught if "log_memory_to_tensorboard is off" in w]
    assert len(off_said) == 1, off_said
    assert "logger.tensorboard_dir" in off_said[0] and "model=" in off_said[0] and "facts=" in off_said[0]
    assert "log_memory_to_tensorboard=True" in off_said[0]
    assert not any(tmp_path.iterdir())
    # Off, and nothing given that it ignores: no word.
    with said() as caught:
        training_log(1, LoggerConfig(memory_record_dir="off"))
    assert not caught


SECRETS_RUN = r"""
import os, sys, warnings
from pathlib import Path
import torch
from nemo_memlog import LoggerConfig, close_writers, training_log

run = Path(sys.argv[1])
key, password = sys.argv[2], sys.argv[3]
cfg = LoggerConfig(
    log_memory_to_tensorboard=True,
    tensorboard_log_interval=2,
    tensorboard_dir=str(run / "tensorboard"),
    wandb_project="memlog-secrets",
    wandb_save_dir=str(run),
    mlflow_experiment="secrets",
    mlflow_run_name="r",
    # No server: the URI's credentials only reach an http one; what matters is that no record keeps them.
    mlflow_tracking_uri=f"http://alice:{password}@127.0.0.1:9",
    comet_project="memlog-secrets",
    comet_api_key=key,
    comet_offline_directory=str(run / "comet"),
    memory_record_dir=str(run / "memory_records"),
)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
facts = {"micro_batch_size": 2, "microbatches": 1, "comet_api_key": key, "uri": f"http://alice:{password}@h"}
for iteration in range(1, 5):
    training_log(iteration, cfg, model=model, optimizer=optimizer, facts=facts)
    model(torch.ones(2, 8)).sum().backward()
close_writers()
"""


@pytest.mark.processes
def test_no_secret_is_written_anywhere_under_the_run_folder(tmp_path):
    """mlflow_tracking_uri="http://alice:PW@host" was stored whole in the TensorBoard config text, the W&B
    run file and debug.log; a fact named comet_api_key was copied into rank-*.layers.json. A run with
    TensorBoard, W&B (offline), Comet (offline archive) and MLflow (pointed at no server: SQLAlchemy
    refuses credentials in a SQLite URI) and those secrets leaves no byte of them under its folder,
    nor in what it printed."""
    key, password = "COMET-KEY-e2e-4242", "URI-PASSWORD-e2e-5151"
    run = tmp_path / "run"
    run.mkdir()
    env = {
        **__import__("os").environ,
        "WANDB_MODE": "offline",
        "COMET_API_KEY": key,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "2",
        **{
            name: str(run / name.lower())
            for name in ("XDG_CACHE_HOME", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")
        },
    }
    done = subprocess.run(
        [sys.executable, "-c", SECRETS_RUN, str(run), key, password],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    written = {path.relative_to(run).as_posix(): path.read_bytes() for path in run.rglob("*") if path.is_file()}
    for part in ("tensorboard/", "wandb/", "comet/", "memory_records/rank-00000.layers.json"):
        assert any(name.startswith(part) for name in written), (part, sorted(written))
    for name, data in written.items():
        for secret in (key, password):
            assert secret.encode() not in data, f"{secret} in {name}"
    layers = json.loads(written["memory_records/rank-00000.layers.json"])
    assert layers["run"]["comet_api_key"] == "***redacted***" and layers["run"]["micro_batch_size"] == 2
    assert b"http://alice:***@127.0.0.1:9" in written["wandb/debug.log"]  # the URI is recorded, its password not
    assert key not in done.stderr and password not in done.stderr
