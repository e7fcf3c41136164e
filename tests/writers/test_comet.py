"""Comet writer: real offline experiments, read back from the zip archives they leave.

The secret is in the config, in COMET_API_KEY and on the command line (``sys.argv``),
where Comet's argument parsing and environment capture would find it if they were on.
"""

import math
import os
import sys
import zipfile

import pytest

from nemo_memlog.config import REDACTED, LoggerConfig, flat_params, secrets_of
from nemo_memlog.writers import comet
from tests.readback import read_archive
from tests.writers.sample import LACKING_FIELDS, SECRET, STEPS, write_steps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("comet")
    cfg = LoggerConfig(
        comet_project="memlog-test",
        comet_workspace="infra",
        comet_experiment_name="pp-run",
        comet_tags=["memory", "pp"],
        comet_api_key=SECRET,
        comet_offline_directory=str(root / "offline"),
    )
    imported_before = "comet_ml" in sys.modules
    with pytest.MonkeyPatch.context() as env:
        env.chdir(root)  # anything written relative to the working directory lands under root
        env.setenv("COMET_API_KEY", SECRET)
        env.delenv("COMET_DISABLE_AUTO_LOGGING", raising=False)
        env.setattr(sys, "argv", ["pretrain.py", f"logger.comet_api_key={SECRET}"])
        backend = comet.open_backend(cfg, flat_params(cfg), secrets_of(cfg))
        hooks_off = "COMET_DISABLE_AUTO_LOGGING" not in os.environ and (
            imported_before or not hasattr(sys.modules["comet_ml"], "MODULE_FINDER")
        )
        write_steps(backend)
        backend.close()
        # No API key and no directory: offline, into the default directory.
        env.delenv("COMET_API_KEY")
        default = comet.open_backend(LoggerConfig(comet_project="memlog-test"), {}, [])
        default.log({"loss": 1.0}, 1)
        default.close()
    (archive,) = (root / "offline").glob("*.zip")
    return root, archive, hooks_off


def test_enabled_only_with_a_project():
    assert comet.enabled(LoggerConfig(comet_project="p"))
    assert not comet.enabled(LoggerConfig())
    assert not comet.enabled(LACKING_FIELDS)


def test_metrics_read_back_with_ints_as_ints_and_non_finite_as_comet_strings(run):
    _, archive, _ = run
    _, messages = read_archive(archive)
    stored = {
        (m["payload"]["metric"]["metricName"], m["payload"]["metric"]["step"]): m["payload"]["metric"]["metricValue"]
        for m in messages
        if m["type"] == "metric_msg"
    }
    special = {math.inf: "Infinity", -math.inf: "-Infinity"}
    for step, metrics in STEPS.items():
        for key, value in metrics.items():
            expected = "NaN" if math.isnan(value) else special.get(value, value)
            assert stored[key, step] == expected and type(stored[key, step]) is type(expected), (key, step)
    assert type(stored["memory/alloc_retries", 10]) is int and type(stored["memory/peak_allocated_gb", 20]) is float


def test_params_name_tags_and_project(run):
    _, archive, _ = run
    experiment, messages = read_archive(archive)
    # Comet files a list-valued parameter under "params", a scalar one under "param".
    entries = [m["payload"].get("param") or m["payload"]["params"] for m in messages if m["type"] == "parameter_msg"]
    params = {p["paramName"]: p["paramValue"] for p in entries if p["source"] == "manual"}
    assert params["comet_api_key"] == REDACTED and params["comet_project"] == "memlog-test"
    assert params["tensorboard_log_interval"] == 1 and params["comet_tags"] == ["memory", "pp"]
    others = {m["payload"]["key"]: m["payload"]["value"] for m in messages if m["type"] == "log_other"}
    assert others["Name"] == "pp-run"
    assert sorted(experiment["tags"]) == ["memory", "pp"]
    assert experiment["project_name"] == "memlog-test" and experiment["workspace"] == "infra"


def test_nothing_captured_from_the_environment(run):
    _, archive, hooks_off = run
    _, messages = read_archive(archive)
    assert {m["type"] for m in messages} <= {"log_other", "parameter_msg", "metric_msg"}
    assert hooks_off  # comet_ml's import hooks were not installed, and the environment was restored


def test_without_key_or_directory_it_writes_offline_to_the_default_directory(run):
    root, _, _ = run
    assert len(list((root / "comet_offline").glob("*.zip"))) == 1


def test_secret_is_written_nowhere_even_inside_the_archives(run):
    root, _, _ = run
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len([p for p in files if p.suffix == ".zip"]) == 2
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), path
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as z:
                for name in z.namelist():
                    assert SECRET.encode() not in z.read(name), (path, name)
