"""MLflow backend: one run, one synchronous ``log_batch`` per logged step (a backlog: per 1000 metrics).

Enabled by ``mlflow_experiment`` (config validation demands ``mlflow_run_name`` too).
Uses its own ``MlflowClient`` on ``mlflow_tracking_uri``: no global fluent state, so it
never touches a run the training script itself has active.

MLflow stores metrics as float64: ints come back as floats (exact up to 2**53). NaN is
stored and read back as NaN. +inf and -inf are accepted, but the SQL stores keep them as
+-1.7976931348623157e308 (the largest float64), which is what reads back.

MLflow names may only hold letters, digits, ``_ - . / `` and space, and must not
normalise to another path. Other characters become ``_`` (``memory/weird key*(1)`` is
logged as ``memory/weird key__1_``; see ``mlflow_name``). The mapping is a pure function
of the name, so a metric keeps its MLflow name across steps and runs. Param and tag
names are mapped the same way; their values are recorded as strings (MLflow's only kind).

Every stage of a metric in one chart: MLflow charts a metric per chart (runs overlaid, not
metrics), so the per-stage metrics keep names that sort together (``memory/pp_stage_{i}/<name>``
beside ``memory/<name>``: the chart search finds them by ``<name>``), and when a run this
backend opened closes, its artifacts get ``memory_per_stage/``: per metric logged per stage a
PNG (matplotlib, the ``report`` extra) with the max and every stage (beyond 10 stages: the max,
the median, the range and the 5 highest stages; charts.py), and ``charts.json`` with every line
as data (thinned to at most 2000 steps; see stages.py). PNGs that would not finish within the
close budget are skipped and said; the run is always ended FINISHED. A run adopted from a
framework gets none: it ends the run, not us.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..redaction import scrubbed
from .base import writable_folder
from .charts import log_figures
from .stages import StageHistory, artifact_name

#: The artifact folder of the per-stage charts, written when the run closes.
CHARTS_FOLDER = "memory_per_stage"
#: Seconds of the close budget kept to end the run (FINISHED) after the charts.
FINISH_RESERVE_S = 2.0

if TYPE_CHECKING:
    from ..config import Settings

MAX_NAME = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
MAX_PARAM_VALUE = 6000  # MAX_PARAM_VAL_LENGTH
PARAMS_PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH
METRICS_PER_BATCH = 1000  # MAX_METRICS_PER_BATCH
# MLflow's set on Windows; other systems also allow ':', but one mapping everywhere is
# what keeps a name stable.
_NOT_ALLOWED = re.compile(r"[^/\w.\- ]")
_NOT_ALLOWED_POSIX = re.compile(r"[^/\w.\- :]")


@functools.lru_cache(maxsize=4096)
def mlflow_name(key: str) -> str:
    """``key`` as a name MLflow accepts: bad characters -> ``_``; empty, ``.`` and ``..``
    path segments -> ``_``; names over 250 characters cut, with a checksum of the whole."""
    return _bounded(_NOT_ALLOWED.sub("_", key), key)


def _bounded(name: str, key: str) -> str:
    """``name`` (``key`` spelled) with empty, ``.`` and ``..`` segments -> ``_`` and cut
    to MLflow's length, with a checksum of ``key``."""
    name = "/".join("_" if segment in ("", ".", "..") else segment for segment in name.split("/"))
    if len(name) > MAX_NAME:
        name = f"{name[: MAX_NAME - 9]}_{zlib.crc32(key.encode()):08x}"
    return name


def enabled(settings: Settings) -> bool:
    return bool(settings.mlflow_experiment)


def open_backend(settings: Settings, params: dict, secrets: list[str]) -> MlflowBackend:
    """A run named ``mlflow_run_name`` (tags ``mlflow_tags``) in ``mlflow_experiment``,
    created if missing, with ``params`` as its params (strings, secrets scrubbed)."""
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    create_sqlite_store(settings.mlflow_tracking_uri, MlflowClient)
    client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
    name = settings.mlflow_experiment
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        try:
            experiment_id = client.create_experiment(
                name, artifact_location=artifact_location(settings.mlflow_tracking_uri)
            )
        except MlflowException:  # another process created it first
            experiment_id = client.get_experiment_by_name(name).experiment_id
    tags = {mlflow_name(str(k)): scrubbed(str(v), secrets) for k, v in (settings.mlflow_tags or {}).items()}
    run = client.create_run(experiment_id, run_name=settings.mlflow_run_name, tags=tags)
    values = [Param(mlflow_name(k), scrubbed(str(v), secrets)[:MAX_PARAM_VALUE]) for k, v in params.items()]
    # The params go with the first write, not here: a failure after the run exists (a server's timeout)
    # retries that write into this run; retried here, the open would make a second run.
    return MlflowBackend(client, run.info.run_id, close_budget_s=settings.writer_close_timeout_s, params=values)


def create_sqlite_store(tracking_uri: str | None, client_class: Callable[..., Any]) -> None:
    """A new SQLite store made whole or not at all: MLflow creates its tables and runs its schema
    migrations for seconds, and a process killed meanwhile (a launcher's teardown) would leave a
    file its own client then cannot open (``CircularDependencyError``). So a store that does not
    exist yet is built in a temporary file beside it and linked into place when complete; a kill
    leaves only that temporary file. An existing store (or another process's, linked first) is used.

    The temporary file is a copy of MLflow's empty store where one is cached for this MLflow version
    (``_copied_empty_store``, kept in ``empty_store_cache()``): milliseconds, where the migrations
    took 2 s of CPU on an idle core and 15 s and more at the writer's nice +10 on a loaded node,
    steps buffering meanwhile. Without a cache (a folder that cannot be written, a copy MLflow's
    client cannot read) MLflow builds it as before."""
    database = _sqlite_path(tracking_uri)
    if database is None or database.exists():
        return
    writable_folder(database.parent, "mlflow_tracking_uri")
    building = database.with_name(f".{database.name}.{os.getpid()}.building")
    building.unlink(missing_ok=True)
    if not _copied_empty_store(building, client_class):
        # A file of its own: MLflow keeps an engine per URI, open on the copy that failed.
        building = database.with_name(f".{database.name}.{os.getpid()}.migrating")
        building.unlink(missing_ok=True)
        client_class(tracking_uri=f"sqlite:///{building}").search_experiments()  # creates and migrates
    try:
        os.link(building, database)  # atomic, and refuses to replace a store another process made
    except FileExistsError:
        pass
    finally:
        building.unlink(missing_ok=True)


def empty_store_cache() -> Path:
    """Where MLflow's empty SQLite store is kept, one file per MLflow version: ``nemo_memlog`` in
    ``$XDG_CACHE_HOME`` (``~/.cache`` without it), as pip, torch and W&B keep theirs."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nemo_memlog"


def _copied_empty_store(building: Path, client_class: Callable[..., Any]) -> bool:
    """Whether ``building`` now holds a copy of MLflow's empty store that MLflow's client opens: its
    tables at this version's schema, no experiment (the client makes its Default one at the first
    open, with this store's own artifact root). The cached copy is made the first time, by MLflow
    itself, then its Default experiment removed. Any failure here is only a slower open."""
    import shutil
    import sqlite3

    import mlflow

    cached = empty_store_cache() / f"mlflow-{mlflow.__version__}-empty.db"
    try:
        if not cached.exists():
            cached.parent.mkdir(parents=True, exist_ok=True)
            made = cached.with_name(f".{cached.name}.{os.getpid()}.{time.monotonic_ns()}.building")  # a new URI
            made.unlink(missing_ok=True)
            try:
                client_class(tracking_uri=f"sqlite:///{made}").search_experiments()  # creates and migrates
                with contextlib.closing(sqlite3.connect(made)) as db, db:
                    db.execute("DELETE FROM experiment_tags")
                    db.execute("DELETE FROM experiments")
                os.replace(made, cached)  # whole or not at all; the same content from any process
            finally:
                made.unlink(missing_ok=True)
        shutil.copyfile(cached, building)
        client_class(tracking_uri=f"sqlite:///{building}").search_experiments()  # opens: the copy is good
        return True
    except Exception:  # a cache that cannot help: MLflow builds the store itself
        building.unlink(missing_ok=True)
        cached.unlink(missing_ok=True)
        return False


def _sqlite_path(tracking_uri: str | None) -> Path | None:
    prefix = "sqlite:///"
    if not tracking_uri or not tracking_uri.startswith(prefix) or tracking_uri == prefix + ":memory:":
        return None
    return Path(tracking_uri[len(prefix) :]).absolute()


def artifact_location(tracking_uri: str | None) -> str | None:
    """Where a new experiment keeps its artifacts: beside a SQLite store's file (``mlartifacts``
    in its folder), so that a run folder holds all of its run; None (MLflow's choice) otherwise.
    MLflow's own default for a SQLite store is ``./mlruns`` under the working directory."""
    database = _sqlite_path(tracking_uri)
    return None if database is None else (database.parent / "mlartifacts").as_uri()


def adopt(obj: Any, spell: Callable[[str], str] | None = None) -> MlflowBackend | None:
    """The ``mlflow`` module with a run active on this thread, opened by someone else (a
    framework such as Megatron-Bridge); else None.

    Writes go to that run through a client holding its id, so they land in it from any
    thread (the fluent API's active run is per thread: elsewhere it silently starts a new
    run on every call). Names are spelled by ``spell(key) -> name``, the framework's own
    rule for its metrics, so our series sort with its own and keep the names its
    dashboards already use (without one: ``/`` -> ``_``, ``memory/peak_reserved_gb`` ->
    ``memory_peak_reserved_gb``); see ``framework_namer``.
    """
    if getattr(obj, "__name__", None) != "mlflow" or not hasattr(obj, "active_run"):
        return None
    run = obj.active_run()
    if run is None:
        return None
    from mlflow.tracking import MlflowClient

    name = framework_namer(spell or _underscored)
    return MlflowBackend(MlflowClient(tracking_uri=obj.get_tracking_uri()), run.info.run_id, name=name, adopted=True)


def _underscored(key: str) -> str:
    return key.replace("/", "_")


def framework_namer(spell: Callable[[str], str]) -> Callable[[str], str]:
    """A cached ``key -> name``: ``spell(key)``, then what MLflow would still refuse made
    safe as ``mlflow_name`` does, except ``:``, which a framework's rule may keep (MLflow
    takes it everywhere but on Windows, where these frameworks do not run)."""

    @functools.lru_cache(maxsize=4096)
    def name(key: str) -> str:
        return _bounded(_NOT_ALLOWED_POSIX.sub("_", spell(key)), key)

    return name


class MlflowBackend:
    #: Steps whose metrics together fit one ``log_batch`` are written by one call (``log_steps``, fanout.py).
    batch_metrics = METRICS_PER_BATCH

    def __init__(
        self,
        client: Any,
        run_id: str,
        name: Callable[[str], str] = mlflow_name,
        adopted: bool = False,
        close_budget_s: float = 25.0,
        params: list | None = None,
    ):
        self.client = client
        self.close_budget_s = close_budget_s
        self.run_id = run_id
        self.name = name
        self.history = None if adopted else StageHistory()  # an adopted run gets no charts at close
        self._params = list(params or [])  # logged with the first write (MLflow takes a param again at its value)

    def log(self, metrics: dict, step: int) -> None:
        """Every metric at ``step`` as a float, in batches of 1000; raises what MLflow raises."""
        self.log_steps([(metrics, step)])

    def log_steps(self, steps: list[tuple[dict, int]]) -> None:
        """Every metric of each (metrics, step) as a float, in batches of 1000 (one call where they fit
        in one: what fanout.py hands over); raises what MLflow raises."""
        from mlflow.entities import Metric

        self._log_params()
        now_ms = int(time.time() * 1000)
        name = self.name
        batch = [Metric(name(k), float(v), now_ms, step) for metrics, step in steps for k, v in metrics.items()]
        for start in range(0, len(batch), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[start : start + METRICS_PER_BATCH], synchronous=True)
        if self.history is not None:
            for metrics, step in steps:
                self.history.add(metrics, step)

    def _log_params(self) -> None:
        """The run's params, once (a failure leaves them to the next write: the same values again)."""
        for start in range(0, len(self._params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=self._params[start : start + PARAMS_PER_BATCH], synchronous=True)
        self._params = []

    def flush(self) -> None:
        pass  # every log_batch is synchronous: written when log returns

    def log_charts(self, deadline: float) -> None:
        """The per-stage charts as artifacts: ``charts.json`` (every line), then a
        ``memory_per_stage/<name>.png`` each while the budget lasts (charts.py)."""
        if self.history is None or not self.history.charts:
            return
        data = json.dumps(self.history.as_dict(), separators=(",", ":"))  # compact: MLflow's log_dict indents
        self.client.log_text(self.run_id, data, f"{CHARTS_FOLDER}/charts.json")

        def log_figure(tag: str, figure: Any) -> None:
            self.client.log_figure(self.run_id, figure, f"{CHARTS_FOLDER}/{artifact_name(tag)}.png")

        where = f"the run's artifact {CHARTS_FOLDER}/charts.json"
        log_figures(self.history, log_figure, deadline - FINISH_RESERVE_S, who="mlflow backend", where=where)

    def close(self, deadline: float | None = None) -> None:
        """Charts while ``deadline`` (default: the close budget from now) allows, then the run FINISHED."""
        try:
            self._log_params()  # a run that never got a step still gets its params
            self.log_charts(time.monotonic() + self.close_budget_s if deadline is None else deadline)
        finally:
            self.client.set_terminated(self.run_id)
