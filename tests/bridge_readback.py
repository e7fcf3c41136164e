"""Read back what a harness run (nemo_memlog/testing/bridge_harness.py) left in its loggers' stores.

Raw, so that duplicates show: TensorBoard events are counted one by one from the event
files (``EventAccumulator`` keeps one event per tag and step), those of the run Bridge opened
apart from the runs the TensorBoard writer opens beside it, one per pipeline stage
(``<log_dir>/pp_stage_{i}/``, writers/tensorboard.py), W&B rows come from the
run's ``.wandb`` log (tests/writers/test_wandb.py's record reader), MLflow histories from
its SQLite store through ``MlflowClient``.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from pathlib import Path

from nemo_memlog.testing.wait import wait_for
from nemo_memlog.writers.stages import STAGE_LABEL
from tests.readback import wandb_log_finished, wandb_records


def stage_run(path: Path) -> str | None:
    """The stage label of an event file in a stage's run (``.../pp_stage_1/events...``), else None."""
    return path.parent.name if STAGE_LABEL.fullmatch(path.parent.name) else None


def tensorboard_events(root) -> tuple[list[Path], dict[str, list[tuple[int, float]]]]:
    """(every event file under root but the stage runs', {tag: [(step, value), ...]} with one
    entry per event)."""
    files = [path for path in sorted(Path(root).rglob("events.out.tfevents.*")) if stage_run(path) is None]
    return files, _scalars(files)


def tensorboard_stage_events(root) -> dict[str, tuple[list[Path], dict[str, list[tuple[int, float]]]]]:
    """Per stage run under root (``pp_stage_{i}``): (its event files, {tag: [(step, value), ...]})."""
    by_stage: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(Path(root).rglob("events.out.tfevents.*")):
        if stage_run(path) is not None:
            by_stage[stage_run(path)].append(path)
    return {stage: (files, _scalars(files)) for stage, files in sorted(by_stage.items())}


def _scalars(files: list[Path]) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    from tensorboard.util import tensor_util

    scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for path in files:
        for event in LegacyEventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars[value.tag].append((event.step, value.simple_value))
                elif value.HasField("tensor") and not value.tensor.string_val:
                    scalars[value.tag].append((event.step, float(tensor_util.make_ndarray(value.tensor))))
    return dict(scalars)


#: How long a reader waits for W&B's service to finish a run's log: ``run.finish()`` returns before the
#: service (wandb-core, a process of its own) has written the last records, and on a loaded machine the
#: log was read with no history rows yet (seen under pytest-xdist; the rows were there a moment later).
FINISHED_WITHIN_S = 30.0


def wandb_run(root) -> tuple[list[Path], dict[int, dict], dict]:
    """(every run log (.wandb file) under root, {step: {key: value}} from the history
    records, the run config as recorded), once every log ends its run (an exit record), or as it
    stands after FINISHED_WITHIN_S. Expects exactly one run; the caller checks."""
    logs = sorted(Path(root).rglob("*.wandb"))
    with contextlib.suppress(AssertionError):  # unfinished by then: read as it stands, for the caller to judge
        wait_for(
            lambda: all(wandb_log_finished(log) for log in logs),
            FINISHED_WITHIN_S,
            "W&B's service to finish writing the run",
        )
    history: dict[int, dict] = {}
    config: dict = {}
    for log in logs:
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                step = int(row["_step"])
                assert step not in history, f"two W&B history rows at step {step}"
                history[step] = row
            elif kind == "run":
                config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    return logs, history, config


def mlflow_runs(uri: str, experiment: str) -> list[dict]:
    """Every run of ``experiment``: {"status", "params", "metrics": {name: [(step, value), ...]}}."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    runs = []
    for run in client.search_runs([found.experiment_id]):
        metrics = {
            name: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
            for name in run.data.metrics
        }
        runs.append({"status": run.info.status, "params": dict(run.data.params), "metrics": metrics})
    return runs


def mlflow_experiments(uri: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    return sorted(e.name for e in MlflowClient(tracking_uri=uri).search_experiments())
