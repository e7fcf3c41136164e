"""``nemo-memlog advise RUN_DIR``: each stage's parts today and under a change, from the run's
per-layer records (measure/layer_record.py), by advice/'s arithmetic. No torch.

``load(path, capacity_gb)`` finds the records (the run folder, its TensorBoard folder beside them, or
the record folder itself) and builds an ``advice.Run``: per stage, the data-parallel rank with the
highest peak. ``as_json`` and ``as_text`` render the outcomes.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import advice
from ..measure import layer_record
from .tables import metric_cell

#: The files that make a folder a record folder.
PATTERN = "rank-*.layers.json"


def gb_cell(value: float | None) -> str:
    """GB as the report prints them: two decimals, two significant digits below 0.01 (a small model)."""
    return metric_cell("part_gb", value)


class AdviseError(Exception):
    """The run cannot be advised on; the message says why and what to do."""


def record_folder(path: str | Path) -> Path:
    """The folder holding the per-layer records for ``path`` (a run, its tensorboard dir, the records)."""
    path = Path(path)
    for folder in (path, path / "memory_records", path.parent / "memory_records"):
        if folder.is_dir() and any(folder.glob(PATTERN)):
            return folder
    raise AdviseError(
        f"no per-layer records ({PATTERN}) in {path} or its memory_records folder: they are written at each "
        f"logging step whose activations were measured, by a run that passes its model (training_log(..., "
        f"model=...), the Megatron-Bridge or Lightning callback) with memory_record_dir not 'off'"
    )


def load(path: str | Path, capacity_gb: float | None = None) -> advice.Run:
    """The run as its records describe it, with ``capacity_gb`` (None: from the records)."""
    try:
        records = layer_record.read_folder(record_folder(path))
    except ValueError as error:
        raise AdviseError(str(error)) from error
    by_stage: dict[int, list[dict]] = {}
    for record in records:
        by_stage.setdefault(int(record["pp_rank"]), []).append(record)
    stages = tuple(_stage(stage, max(ranks, key=_peak_of)) for stage, ranks in sorted(by_stage.items()))
    first = records[0]
    facts = first.get("run", {})
    gpu = any("peak_reserved_gb" in record["stage"] for record in records)
    capacity, source = (capacity_gb, "--capacity-gb") if capacity_gb is not None else _capacity(records, gpu)
    return advice.Run.of(stages, first, facts, gpu=gpu, capacity_gb=capacity, capacity_source=source)


def _parts(stage: dict) -> dict:
    return advice.stage_parts(stage.get, "peak_reserved_gb" in stage)


def _stage(stage: int, record: dict) -> advice.Stage:
    figures = record["stage"]
    return advice.Stage(
        stage=stage,
        parts=_parts(figures),
        in_flight=figures.get("microbatches_in_flight"),
        chunks=int(figures.get("chunks", 1)),
        layers=tuple(record.get("layers", ())),
        rank=record["rank"],
    )


def _peak_of(record: dict) -> float:
    return advice.peak(_parts(record["stage"]))


def _capacity(records: list[dict], gpu: bool) -> tuple[float | None, str]:
    """GPU: the device's memory. CPU: the job's memory cgroup limit, else the node's RAM shared by its ranks."""
    stage = records[0]["stage"]
    if gpu and stage.get("device_total_gb"):
        return float(stage["device_total_gb"]), "the device's total memory"
    ranks = max(int(records[0].get("local_world_size", 1)), 1)
    if stage.get("host_limit_gb"):
        return float(stage["host_limit_gb"]) / ranks, f"the job's memory cgroup limit / {ranks} ranks under it"
    if stage.get("host_total_gb"):
        return float(stage["host_total_gb"]) / ranks, f"the node's RAM / {ranks} ranks on it"
    return None, "unknown"


def as_json(run: advice.Run, changes: list[advice.Change], outcomes: list[advice.Outcome], best: tuple) -> str:
    """The contract: {"stages": [{"stage", "now", "predicted", "peak_gb", "capacity_gb", "fits", ...}], ...}."""
    return json.dumps(
        {
            "changes": [change.text for change in changes],
            "assumptions": outcomes[0].assumptions if outcomes else [],
            "capacity_gb": run.capacity_gb,
            "capacity_source": run.capacity_source,
            "pp_size": run.pp_size,
            "dp_size": run.dp_size,
            "microbatches": run.microbatches,
            "micro_batch_size": run.micro_batch_size,
            "stages": [
                {
                    "stage": outcome.stage,
                    "now": outcome.now,
                    "predicted": outcome.predicted,
                    "in_flight_now": outcome.in_flight_now,
                    "in_flight": outcome.in_flight,
                    "peak_now_gb": outcome.peak_now_gb,
                    "peak_gb": outcome.peak_gb,
                    "capacity_gb": outcome.capacity_gb,
                    "headroom_gb": outcome.headroom_gb,
                    "fits": outcome.fits,
                }
                for outcome in outcomes
            ],
            "fits": all(outcome.fits for outcome in outcomes) if run.capacity_gb is not None else None,
            "max_micro_batch_size": best[0],
            "max_micro_batch_size_how": best[1],
        },
        indent=1,
    )


LABELS = {
    "params_gb": "parameters",
    "grads_gb": "gradients",
    "optimizer_state_gb": "optimizer state",
    "activations_gb": "activations",
    "temporaries_gb": "temporaries",
    "allocator_slack_gb": "allocator slack",
    "outside_gb": "outside the allocator",
}


def as_text(run: advice.Run, changes: list[advice.Change], outcomes: list[advice.Outcome], best: tuple) -> str:
    """Per stage: each part today and predicted, the peak, capacity and headroom; then what fits."""
    what = " + ".join(change.text for change in changes) or "no change (today's figures)"
    capacity = f"{gb_cell(run.capacity_gb)} GB ({run.capacity_source})" if run.capacity_gb else "unknown"
    lines = [f"what-if: {what}", f"capacity per rank: {capacity}; PP {run.pp_size}, DP {run.dp_size}", ""]
    outside = "outside the allocator" if run.gpu else "rest of the process"
    header = f"{'part (GB)':<24}" + "".join(f"{'stage ' + str(o.stage):>22}" for o in outcomes)
    lines += [header, f"{'':<24}" + "".join(f"{'now -> predicted':>22}" for _ in outcomes), "-" * len(header)]
    for name in advice.PARTS:
        if all(o.now.get(name) is None for o in outcomes):
            continue
        label = outside if name == "outside_gb" else LABELS[name]
        cells = [f"{gb_cell(o.now.get(name))} -> {gb_cell(o.predicted.get(name))}" for o in outcomes]
        lines.append(f"{label:<24}" + "".join(f"{c:>22}" for c in cells))
    rows = (
        ("microbatches in flight", [f"{o.in_flight_now} -> {o.in_flight}" for o in outcomes]),
        ("peak", [f"{gb_cell(o.peak_now_gb)} -> {gb_cell(o.peak_gb)}" for o in outcomes]),
        ("headroom", [gb_cell(o.headroom_gb) for o in outcomes]),
        ("fits", ["yes" if o.fits else "NO" if o.fits is not None else "-" for o in outcomes]),
    )
    for label, cells in rows:
        lines.append(f"{label:<24}" + "".join(f"{c:>22}" for c in cells))
    if outcomes and outcomes[0].assumptions:
        lines += ["", "assumptions:"] + [f"  - {text}" for text in outcomes[0].assumptions]
    size, how = best
    lines.append("")
    if size is not None:
        lines.append(f"largest micro-batch size that fits on every stage: {size} ({how}; today {run.micro_batch_size})")
    else:
        lines.append(f"largest micro-batch size that fits: not predicted ({how})")
    return "\n".join(lines)
