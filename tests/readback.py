"""Read back what a run wrote to each backend, from the stores themselves: the steps at which TAG
was stored, TensorBoard's runs, a W&B run log's records, a Comet archive.

A run directory holds ``tensorboard/`` (event files), ``mlflow.db`` (an MLflow SQLite
store), ``wandb/`` (W&B offline runs) and ``comet/`` (Comet offline archives), as the demo
and tests/trainer.py write them. The backends' libraries are imported where they are read.
"""

import contextlib
import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

from nemo_memlog.failure import records

ROOT = Path(__file__).resolve().parents[1]

TAG = "memory/peak_host_rss_gb"


def stored_steps(run, skip=()) -> dict[str, set[int]]:
    """Backend name -> the steps at which TAG is stored there (the backends in ``skip`` not read)."""
    readers = {"tensorboard": tensorboard_steps, "mlflow": mlflow_steps, "wandb": wandb_steps, "comet": comet_steps}
    return {name: read(run) for name, read in readers.items() if name not in skip}


def tensorboard_steps(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = set()
    for events in (run / "tensorboard").rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if TAG in accumulator.Tags()["scalars"]:
            steps |= {event.step for event in accumulator.Scalars(TAG)}
    return steps


def tensorboard_runs(folder) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Every TensorBoard run under ``folder``, as TensorBoard names them (``.`` for ``folder``
    itself, ``pp_stage_1`` for a stage's run): {run: {tag: [(step, value), ...]}}, read with
    TensorBoard's own EventAccumulator (one folder, one run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {}
    for directory in sorted({path.parent for path in folder.rglob("events.out.tfevents.*")}):
        accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        accumulator.Reload()
        runs[str(directory.relative_to(folder))] = {
            tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]
        }
    return runs


def mlflow_steps(run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    experiments = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in experiments])
    return {m.step for r in runs for m in client.get_metric_history(r.info.run_id, TAG)}


def mlflow_rows_so_far(run) -> int:
    """TAG's rows in the MLflow SQLite store, read with sqlite3 while its writer may still be creating
    it (MlflowClient would create the store and run its migrations itself): 0 until the table is there."""
    import sqlite3

    path = run / "mlflow.db"
    if not path.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)) as db:
            return db.execute("SELECT COUNT(*) FROM metrics WHERE key = ?", (TAG,)).fetchone()[0]
    except sqlite3.Error:  # no table yet, or locked by a migration
        return 0


def wandb_steps(run):
    steps = set()
    for log in (run / "wandb").glob("offline-run-*/run-*.wandb"):
        for record in wandb_records(log):
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                if TAG in items:
                    steps.add(int(items["_step"]))
    return steps


def comet_steps(run):
    steps = set()
    for archive in (run / "comet").glob("*.zip"):
        _, messages = read_archive(archive)
        for message in messages:
            text = json.dumps(message)
            if TAG in text:
                steps |= {int(s) for s in re.findall(r'"step": (\d+)', text)}
    return steps


def wandb_finished(run) -> bool:
    """Every W&B run under ``run`` was finished: its log ends the run with an exit record."""
    logs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    return bool(logs) and all(wandb_log_finished(log) for log in logs)


def wandb_log_finished(log) -> bool:
    """The W&B run log (.wandb file) ``log`` holds its run's exit record."""
    return any(record.WhichOneof("record_type") == "exit" for record in wandb_records(log))


def main_run_events(folder) -> list:
    """The event files under ``folder`` outside the per-stage runs (``pp_stage_<i>/``): the main run's."""
    folder = Path(folder)
    found = folder.rglob("events.out.tfevents.*")
    return sorted(p for p in found if not any(part.startswith("pp_stage_") for part in p.relative_to(folder).parts))


def wandb_records(path: Path):
    """The protobuf records of a .wandb file (a LevelDB-style log: 7-byte file header,
    32 KiB blocks of chunks, each with a 7-byte header: crc32, length, kind)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated protobuf
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_archive(archive):
    """A Comet offline archive (.zip): (its experiment.json, its messages.json, one message a line)."""
    with zipfile.ZipFile(archive) as z:
        experiment = json.loads(z.read("experiment.json"))
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]
    return experiment, messages


# --- what the package writes apart from the backends: the post-mortem, flight records, PNGs ---


def postmortem(run_dir: Path) -> tuple[int, dict]:
    done = subprocess.run(
        [sys.executable, "-m", "nemo_memlog.cli", "postmortem", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def read_back(path):
    """(header, liveness, records in seq order) of one rank's file, decoded with records.py."""
    data = Path(path).read_bytes()
    header = records.check_header(records.decode(data[: records.HEADER_BYTES]))
    liveness = records.decode(data[records.HEADER_BYTES : records.RECORDS_AT])
    size = header["slot_bytes"]
    found = [
        records.decode(data[records.RECORDS_AT + i * size : records.RECORDS_AT + (i + 1) * size])
        for i in range(header["slots"])
    ]
    return header, liveness, sorted((r for r in found if r is not None), key=lambda r: r["seq"])


def png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24]), len(data)
