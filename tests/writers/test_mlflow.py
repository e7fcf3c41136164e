"""MLflow writer: one real run in a SQLite store, read back with MlflowClient."""

import math
import sqlite3
import sys

import mlflow
import pytest

from nemo_memlog.config import REDACTED, LoggerConfig, flat_params, secrets_of
from nemo_memlog.writers import mlflow as mlflow_writer
from tests.writers.sample import LACKING_FIELDS, SECRET, STEPS, write_steps

DBL_MAX = sys.float_info.max


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    cfg = LoggerConfig(
        mlflow_experiment="memlog-test",
        mlflow_run_name="pp-run",
        mlflow_tracking_uri=uri,
        mlflow_tags={"team": "infra", "token_source": SECRET},
        comet_api_key=SECRET,
    )
    with pytest.MonkeyPatch.context() as env:
        env.chdir(root)  # anything written relative to the working directory lands under root
        backend = mlflow_writer.open_backend(cfg, flat_params(cfg), secrets_of(cfg))
        write_steps(backend)
        backend.close()
        # A second run in the same experiment: get-or-create finds it.
        second = mlflow_writer.open_backend(cfg, {"x": 1}, secrets_of(cfg))
        second.close()

    from mlflow.tracking import MlflowClient

    return root, MlflowClient(uri), backend.run_id, second.run_id, cfg


def test_enabled_only_with_an_experiment():
    assert mlflow_writer.enabled(LoggerConfig(mlflow_experiment="e", mlflow_run_name="r"))
    assert not mlflow_writer.enabled(LoggerConfig())
    assert not mlflow_writer.enabled(LACKING_FIELDS)


def test_names_mlflow_rejects_are_mapped_not_dropped():
    from mlflow.utils.validation import _validate_metric_name

    assert mlflow_writer.mlflow_name("memory/peak_allocated_gb") == "memory/peak_allocated_gb"
    assert mlflow_writer.mlflow_name("memory/weird key*(1)") == "memory/weird key__1_"
    for key in ("memory/weird key*(1)", "/a//b/", "a/../b", "rank:3", "", "x" * 300, "a" * 300 + "b"):
        _validate_metric_name(mlflow_writer.mlflow_name(key))  # raises if MLflow would reject it
    assert mlflow_writer.mlflow_name("x" * 300) != mlflow_writer.mlflow_name("x" * 299 + "y")


def test_a_frameworks_spelling_is_kept_and_what_mlflow_rejects_still_mapped():
    from mlflow.utils.validation import _validate_metric_name

    def spell(key):  # a framework's rule: the first '/' kept, ':' kept (Megatron-Bridge 0.4+ keeps both)
        first, _, rest = key.partition("/")
        return f"{first}/{rest.replace('/', '_')}" if rest else first

    name = mlflow_writer.framework_namer(spell)
    assert name("memory/pp_stage_0/peak_host_rss_gb") == "memory/pp_stage_0_peak_host_rss_gb"
    assert name("memory/rank:3") == "memory/rank:3"
    assert name("memory/weird key*(1)") == "memory/weird key__1_"
    for key in ("memory/weird key*(1)", "/a//b/", "a/../b", "rank:3", "", "x" * 300, "memory/"):
        _validate_metric_name(name(key))  # raises if MLflow would reject it


def test_every_metric_reads_back_at_its_step(run):
    _, client, run_id, *_ = run
    for key in STEPS[10]:
        history = client.get_metric_history(run_id, mlflow_writer.mlflow_name(key))
        assert [m.step for m in history] == [10, 20], key
        for metric, step in zip(history, STEPS):
            expected = STEPS[step][key]
            if math.isnan(expected):
                assert math.isnan(metric.value)
            elif math.isinf(expected):
                assert metric.value == math.copysign(DBL_MAX, expected)  # the SQL store's stand-in
            else:
                assert metric.value == expected and type(metric.value) is float


def test_run_name_tags_params_and_status(run):
    root, client, run_id, second_id, cfg = run
    stored = client.get_run(run_id)
    assert stored.info.run_name == "pp-run" and stored.info.status == "FINISHED"
    assert stored.data.tags["team"] == "infra" and stored.data.tags["token_source"] == REDACTED
    params = stored.data.params
    assert params["comet_api_key"] == REDACTED
    assert params["mlflow_experiment"] == "memlog-test" and params["tensorboard_log_interval"] == "1"
    assert params["wandb_project"] == "None"
    assert params.keys() == flat_params(cfg).keys()  # every one, dotted names kept
    assert params["mlflow_tags.token_source"] == REDACTED
    assert client.get_run(second_id).info.experiment_id == stored.info.experiment_id
    # Artifacts beside the store, inside the run's folder, not under the working directory's mlruns:
    experiment = client.get_experiment(stored.info.experiment_id)
    assert experiment.artifact_location == (root / "mlartifacts").as_uri()
    assert not (root / "mlruns").exists()


def test_secret_is_written_nowhere(run):
    root, *_ = run
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files)
    assert [p for p in files if SECRET.encode() in p.read_bytes()] == []
    with sqlite3.connect(root / "mlflow.db") as db:  # and not in any text column either
        for (table,) in db.execute("select name from sqlite_master where type='table'").fetchall():
            assert SECRET not in repr(db.execute(f"select * from {table}").fetchall()), table


def test_a_backlog_is_caught_up_in_a_call_per_thousand_metrics_and_every_step_stored(tmp_path, monkeypatch):
    """120 steps of 20 metrics handed over while the store is still being created (its migrations take
    seconds): the first step is written alone once the run is open, the other 119 in log_batch calls of at
    most 1000 metrics (3, where one call per step made 119), every step read back at its value."""
    from mlflow.tracking import MlflowClient

    from nemo_memlog import build_writers

    calls = []
    real = MlflowClient.log_batch

    def counted(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        if metrics:
            calls.append(len(metrics))
        return real(self, run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous)

    monkeypatch.setattr(MlflowClient, "log_batch", counted)
    monkeypatch.setattr(mlflow_writer, "empty_store_cache", lambda: tmp_path / "cache")  # none cached: migrations
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = LoggerConfig(mlflow_experiment="backlog", mlflow_run_name="r", mlflow_tracking_uri=uri, writer_mode="thread")
    fanout = build_writers(cfg)
    for step in range(1, 121):
        fanout.log({f"memory/pp_stage_{i % 2}/m{i}": float(step * 100 + i) for i in range(20)}, step)
    assert fanout.flush(timeout_s=120)
    stats = fanout.stats()["mlflow"]
    fanout.close()
    client = MlflowClient(uri)
    (stored,) = client.search_runs([client.get_experiment_by_name("backlog").experiment_id])
    history = client.get_metric_history(stored.info.run_id, "memory/pp_stage_1/m7")
    assert sorted((m.step, m.value) for m in history) == [(step, step * 100 + 7.0) for step in range(1, 121)]
    assert stats["written"] == 120 and sum(calls) == 120 * 20 and max(calls) <= 1000
    print("metrics per log_batch call:", calls)
    assert calls[0] == 20 and len(calls) <= 1 + math.ceil(119 * 20 / 1000), calls  # opened late: the backlog batched


def _schema(database) -> list:
    """The tables, indexes and columns of a SQLite store and its schema version (not the text of its
    CHECK constraints: MLflow writes their lists in set order, which differs from process to process)."""
    with sqlite3.connect(database) as db:
        names = sorted(db.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
        columns = {name: list(db.execute(f'PRAGMA table_info("{name}")')) for kind, name in names if kind == "table"}
        return [names, columns, list(db.execute("SELECT version_num FROM alembic_version"))]


def test_a_new_store_is_a_copy_of_mlflows_empty_one_and_a_copy_it_cannot_read_is_made_again(tmp_path, monkeypatch):
    """The first store on a machine is built by MLflow (its migrations), the next ones copied from the
    empty store cached then (no migration runs): the tables and schema version of a store MLflow builds
    itself, read apart, and the Default experiment MLflow makes at the first open, with this store's
    artifact root. A cached file MLflow cannot read is replaced; that store is built by MLflow."""
    import mlflow.store.db.utils as db_utils
    from mlflow.tracking import MlflowClient

    monkeypatch.setattr(mlflow_writer, "empty_store_cache", lambda: tmp_path / "cache")
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root (./mlruns) is under the working folder
    MlflowClient(f"sqlite:///{tmp_path}/apart.db").search_experiments()  # MLflow's own, for comparison
    migrations = []
    real = db_utils._initialize_tables
    monkeypatch.setattr(db_utils, "_initialize_tables", lambda engine: (migrations.append(engine.url), real(engine)))

    def experiments(client) -> list:
        return [(e.experiment_id, e.name, e.artifact_location) for e in client.search_experiments()]

    def made(name: str) -> int:
        before = len(migrations)
        mlflow_writer.create_sqlite_store(f"sqlite:///{tmp_path}/{name}.db", MlflowClient)
        return len(migrations) - before

    cached = mlflow_writer.empty_store_cache() / f"mlflow-{mlflow.__version__}-empty.db"
    assert made("first") == 1 and cached.is_file(), "built by MLflow, once, for the cache"
    assert made("second") == 0, "copied"
    for name in ("first", "second"):
        assert _schema(tmp_path / f"{name}.db") == _schema(tmp_path / "apart.db")
        client = MlflowClient(f"sqlite:///{tmp_path}/{name}.db")
        assert experiments(client) == experiments(MlflowClient(f"sqlite:///{tmp_path}/apart.db"))
        assert experiments(client) == [("0", "Default", str(tmp_path / "mlruns" / "0"))], "this store's own root"
        run = client.create_run(client.create_experiment(f"e-{name}"))
        client.log_metric(run.info.run_id, "memory/peak_host_rss_gb", 1.5, step=7)
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "memory/peak_host_rss_gb")] == [
            (7, 1.5)
        ]
    cached.write_bytes(b"not a SQLite file")
    assert made("after_a_bad_copy") == 1 and _schema(tmp_path / "after_a_bad_copy.db") == _schema(tmp_path / "apart.db")
    assert made("then") == 1 and made("and_then") == 0, "the bad copy was dropped, and made again"
