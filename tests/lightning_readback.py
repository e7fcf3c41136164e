"""Read back what a Lightning fit (tests/lightning_job.py) left in each of its loggers' stores.

``series(backend, fit_dir)`` gives ``{name: [(step, value), ...]}`` for every metric the
backend stored, in store order, one entry per stored value (so duplicates show), with the
step Lightning gave ``log_metrics``. ``runs(backend, fit_dir)`` counts the runs it holds.
Backend bookkeeping that changes from run to run (W&B's ``_runtime``, Comet's ``sys.*``
system metrics) is left out.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from tests.bridge_readback import mlflow_runs, tensorboard_events, wandb_run
from tests.readback import read_archive

BACKENDS = ("tensorboard", "csv", "mlflow", "wandb", "comet")
EXPERIMENT = "memlog-lightning"  # tests/lightning_job.py's MLflow experiment and W&B/Comet project


def series(backend: str, fit_dir: Path) -> dict[str, list[tuple[int, float]]]:
    return _READERS[backend](Path(fit_dir))


def runs(backend: str, fit_dir: Path) -> int:
    fit_dir = Path(fit_dir)
    if backend == "tensorboard":
        return len(tensorboard_events(fit_dir / "tb")[0])
    if backend == "csv":
        return len(list((fit_dir / "csv").glob("version_*/metrics.csv")))
    if backend == "mlflow":
        return len(mlflow_runs(_mlflow_uri(fit_dir), EXPERIMENT))
    if backend == "wandb":
        return len(wandb_run(fit_dir / "wandb")[0])
    return len(list((fit_dir / "comet").glob("*.zip")))


def _tensorboard(fit_dir):
    return tensorboard_events(fit_dir / "tb")[1]


def _csv(fit_dir):
    out = defaultdict(list)
    (path,) = (fit_dir / "csv").glob("version_*/metrics.csv")
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row.pop("step"))
            for name, value in row.items():
                if value != "":
                    out[name].append((step, float(value)))
    return dict(out)


def _mlflow_uri(fit_dir):
    return f"sqlite:///{fit_dir}/mlflow.db"


def _mlflow(fit_dir):
    (run,) = mlflow_runs(_mlflow_uri(fit_dir), EXPERIMENT)
    return run["metrics"]


def _wandb(fit_dir):
    """WandbLogger logs each ``log_metrics`` call as a row of its own, with Lightning's step
    in it as ``trainer/global_step`` (the step here, not a series); W&B's ``_step`` counts rows."""
    _, history, _ = wandb_run(fit_dir / "wandb")
    out = defaultdict(list)
    for _, row in sorted(history.items()):
        step = int(row["trainer/global_step"])
        for name, value in row.items():
            if not name.startswith("_") and name != "trainer/global_step":
                out[name].append((step, value))
    return dict(out)


def _comet(fit_dir):
    """Comet's offline archive (comet_ml 3.58) holds each value Lightning's CometLogger logs
    twice, Lightning's own metrics alike: one entry per (step, value) here."""
    (archive,) = (fit_dir / "comet").glob("*.zip")
    _, messages = read_archive(archive)
    out = defaultdict(list)
    for message in messages:
        metric = message["payload"].get("metric") if message["type"] == "metric_msg" else None
        if metric and not metric["metricName"].startswith("sys."):
            entry = (metric["step"], metric["metricValue"])
            if entry not in out[metric["metricName"]]:
                out[metric["metricName"]].append(entry)
    return dict(out)


_READERS = {"tensorboard": _tensorboard, "csv": _csv, "mlflow": _mlflow, "wandb": _wandb, "comet": _comet}
