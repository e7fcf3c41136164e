"""``nemo-memlog advise RUN_DIR``: each stage's parts today and under a change, from the run's
per-layer records (measure/layer_record.py), by advice/'s arithmetic. No torch.

``load(path, capacity_gb)`` finds the records (the run folder, its TensorBoard folder beside them, or
the record folder itself) and builds an ``advice.Profile``: per stage, the data-parallel rank with the
highest peak. ``as_json`` and ``as_text`` render the outcomes. Beside it:

- ``plot``: the PNG, per stage today's stacked bar beside the predicted one, against the capacity.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ... import advice, parts
from ...bounded import ReadBudget
from ...keys import DEVICE_TOTAL, HOST_LIMIT, HOST_TOTAL, PEAK_RESERVED
from ...measure import layer_record
from ...parts import label_of
from .. import node_charge
from ..tables import printable, size_text

#: The files that make a folder a record folder.
PATTERN = "rank-*.layers.json"


def gb_cell(value: float | None) -> str:
    """A size as the report prints it, by the units rule (tables.size_text): "1.84 GB", "8.4 MB"."""
    return size_text(value)


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


def load(path: str | Path, capacity_gb: float | None = None, budget: ReadBudget | None = None) -> advice.Profile:
    """The run as its records describe it, with ``capacity_gb`` (None: from the records). Raises
    AdviseError naming the file and field of a record that cannot be used, and for a folder whose
    records are not one run's: several layouts (stale records of another run), or a stage missing.
    ``budget``: the command's read budget for the run's files (bounded.ReadBudget: its cap, its progress)."""
    try:
        found = layer_record.read_folder_files(record_folder(path), budget)
    except ValueError as error:
        raise AdviseError(str(error)) from error
    for file, record in found:
        _check_record(file, record)
    records = [record for _, record in found]
    _check_one_run(found)
    by_stage: dict[int, list[dict]] = {}
    for record in records:
        by_stage.setdefault(int(record["pp_rank"]), []).append(record)
    stages = tuple(_stage(stage, max(ranks, key=_peak_of)) for stage, ranks in sorted(by_stage.items()))
    first = records[0]
    facts = first.get("run") or {}
    gpu = any(PEAK_RESERVED.key in record["stage"] for record in records)
    capacity, source = (capacity_gb, "--capacity-gb") if capacity_gb is not None else _capacity(records, gpu)
    nodes = node_charge.nodes_of(records) if capacity_gb is None and not gpu else ()
    if nodes:
        source += "; " + node_charge.capacity_text(nodes)
    run = advice.Profile.of(stages, first, facts, gpu=gpu, capacity_gb=capacity, capacity_source=source)
    return dataclasses.replace(run, nodes=nodes)


# ---- checking what a record says before any of it is used ------------------------------------

#: Whole-number fields of a record: (lowest, highest); the sizes and ranks of a layout.
_LAYOUT = {
    "rank": (0, 1 << 22),
    "world_size": (1, 1 << 22),
    "pp_rank": (0, 1 << 16),
    "pp_size": (1, 1 << 16),
    "tp_rank": (0, 1 << 16),
    "tp_size": (1, 1 << 16),
    "dp_rank": (0, 1 << 22),
    "dp_size": (1, 1 << 22),
    "local_world_size": (1, 1 << 16),
}
#: Facts (the record's "run") advice/ computes with, and what each must be.
_WHOLE_FACTS = {"microbatches": (1, 1 << 53), "micro_batch_size": (1, 1 << 53)}
_WHOLE_FACTS["microbatch_group_size_per_vp_stage"] = (1, 1 << 16)
_TEXT_FACTS = ("recompute", "schedule", "optimizer")
#: The largest GB figure taken as measured (a petabyte): beyond it a figure is garbage.
MAX_GB = 1e6
_LAYER_FIGURES: tuple[str, ...] = (*parts.MODEL_STATE_PARTS, parts.ACTIVATIONS_PER_MICROBATCH.key)
_LAYER_FIGURES += ("input_per_microbatch_gb",)


def _field_error(path: Path, key: str, value: object, expected: str) -> AdviseError:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return AdviseError(f"{path}: field {key!r}: {shown} is not {expected}")


def _whole(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _gb_figure(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= MAX_GB


def _nan(value: object) -> bool:
    return isinstance(value, float) and value != value


def _size(value: object) -> bool:
    """A size as a record holds it: a finite number of GB from 0 to MAX_GB (NaN, the infinities and a
    negative size are not: advise would predict from them, and say "fits")."""
    return _gb_figure(value) and value == value and value >= 0  # type: ignore[operator]


def _check_record(path: Path, record: dict) -> None:
    """AdviseError naming ``path`` and the field, for the first field of ``record`` that cannot be used."""
    for key, (low, high) in _LAYOUT.items():
        required = key in ("rank", "pp_rank")
        if (required or record.get(key) is not None) and not _whole(record.get(key), low, high):
            raise _field_error(path, key, record.get(key), f"a whole number from {low} to {high}")
    for rank, size in (("pp_rank", "pp_size"), ("tp_rank", "tp_size"), ("dp_rank", "dp_size"), ("rank", "world_size")):
        if record.get(size) is not None and record.get(rank) is not None and record[rank] >= record[size]:
            raise _field_error(path, rank, record[rank], f"below its {size} ({record[size]})")
    facts = record.get("run", {})
    if not isinstance(facts, dict):
        raise _field_error(path, "run", facts, "an object (the run's facts)")
    for key, (low, high) in _WHOLE_FACTS.items():
        if facts.get(key) is not None and not _whole(facts[key], low, high):
            raise _field_error(path, f"run.{key}", facts[key], f"a whole number from {low} to {high}")
    for key in _TEXT_FACTS:
        if facts.get(key) is not None and not isinstance(facts[key], str):
            raise _field_error(path, f"run.{key}", facts[key], "a text")
    ratio = facts.get("selective_recompute_ratio")
    if ratio is not None and not (_gb_figure(ratio) and 0 <= ratio <= 1):
        raise _field_error(path, "run.selective_recompute_ratio", ratio, "a number from 0 to 1")
    stage = record.get("stage")
    if not isinstance(stage, dict):
        raise _field_error(path, "stage", stage, "an object (the stage's figures)")
    for key, value in stage.items():
        if key == "microbatches_in_flight":  # NaN: not measured
            if value is not None and value == value and not _whole(value, 0, 1 << 53):
                raise _field_error(path, f"stage.{key}", value, "a whole number >= 0")
        elif key == "chunks":
            if not _whole(value, 1, 1 << 16):
                raise _field_error(path, f"stage.{key}", value, "a whole number from 1")
        elif value is not None and not _size(value):  # a figure not measured is left out, never NaN
            raise _field_error(path, f"stage.{key}", value, f"a size: a finite number of GB from 0 to {MAX_GB:g}")
    layers = record.get("layers", [])
    if not isinstance(layers, list):
        raise _field_error(path, "layers", layers, "a list")
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise _field_error(path, f"layers[{i}]", layer, "an object")
        if not isinstance(layer.get("kind"), str):
            raise _field_error(path, f"layers[{i}].kind", layer.get("kind"), "a text")
        for key in _LAYER_FIGURES:
            value = layer.get(key)
            if not _size(value):
                raise _field_error(
                    path, f"layers[{i}].{key}", value, f"a size: a finite number of GB from 0 to {MAX_GB:g}"
                )


def _layout(record: dict) -> tuple:
    return tuple(record.get(key) for key in ("pp_size", "tp_size", "dp_size", "world_size"))


def _layout_text(layout: tuple) -> str:
    pp, tp, dp, world = ("?" if value is None else value for value in layout)
    return f"PP {pp} x TP {tp} x DP {dp} (world size {world})"


def _check_one_run(found: list[tuple[Path, dict]]) -> None:
    """AdviseError for records of several layouts (a stale run's records beside this one's) or a stage
    with no record: advice from part of a run, or two runs mixed, would be wrong without saying so."""
    layouts: dict[tuple, list[Path]] = {}
    for path, record in found:
        layouts.setdefault(_layout(record), []).append(path)
    folder = found[0][0].parent
    if len(layouts) > 1:
        listed = "; ".join(
            f"{_layout_text(layout)}: {len(paths)} file(s), {_names(paths)}" for layout, paths in layouts.items()
        )
        raise AdviseError(
            f"{folder}: the per-layer records are of more than one run layout ({listed}); one run's records "
            "per folder: move the other run's (stale) files away, or point at the folder of the run to advise on"
        )
    pp_size = found[0][1].get("pp_size") or 1
    stages = {record["pp_rank"] for _, record in found}
    missing = sorted(set(range(pp_size)) - stages)
    if missing:
        raise AdviseError(
            f"{folder}: no per-layer record of pipeline stage(s) {', '.join(map(str, missing))} of PP {pp_size} "
            f"(records found for stage(s) {', '.join(map(str, sorted(stages)))}, {_names([p for p, _ in found])}); "
            "whether the run fits depends on every stage: copy the missing ranks' rank-*.layers.json too"
        )


def _names(paths: list[Path]) -> str:
    names = [path.name for path in paths]
    return ", ".join(names[:4]) + (f" ... ({len(names)} in all)" if len(names) > 4 else "")


def _parts(stage: dict) -> dict:
    return advice.stage_parts(stage.get, PEAK_RESERVED.key in stage)


def _stage(stage: int, record: dict) -> advice.Stage:
    figures = record["stage"]
    return advice.Stage(
        stage=stage,
        parts=_parts(figures),
        in_flight=figures.get("microbatches_in_flight") if not _nan(figures.get("microbatches_in_flight")) else None,
        chunks=int(figures.get("chunks", 1)),
        layers=tuple(record.get("layers", ())),
        rank=record["rank"],
    )


def _peak_of(record: dict) -> float:
    return advice.peak(_parts(record["stage"]))


def _capacity(records: list[dict], gpu: bool) -> tuple[float | None, str]:
    """GPU: the device's memory. CPU: the job's memory cgroup limit, else the node's RAM shared by its ranks."""
    stage = records[0]["stage"]

    def positive(key: str) -> float | None:  # NaN, 0 or below: not known
        value = stage.get(key)
        return float(value) if value is not None and value == value and value > 0 else None

    if gpu and positive(DEVICE_TOTAL.key):
        return positive(DEVICE_TOTAL.key), "the device's total memory"
    ranks = max(int(records[0].get("local_world_size") or 1), 1)
    shared = f"shared by {ranks} ranks" if ranks > 1 else "one rank"
    limit = positive(HOST_LIMIT.key)
    if limit:
        return limit / ranks, f"the job's memory cgroup limit {size_text(limit)}, {shared} under it"
    total = positive(HOST_TOTAL.key)
    if total:
        return total / ranks, f"host memory {size_text(total)}, {shared} on this node"
    return None, "unknown"


def capacity_line(profile: advice.Profile) -> str:
    """The capacity per rank and where it came from, as ``report`` and ``advise`` both say it:
    "capacity per rank: 6.32 GB (host memory 25.28 GB, shared by 4 ranks on this node)"."""
    if not profile.capacity_gb:
        return "capacity per rank: unknown (no device or host total in the records; --capacity-gb GB)"
    return f"capacity per rank: {size_text(profile.capacity_gb)} ({profile.capacity_source})"


def replica_line(profile: advice.Profile) -> str:
    """Whose record each stage's figures are: per stage, the data-parallel rank with the highest peak."""
    ranks = ", ".join(f"stage {stage.stage} rank {stage.rank}" for stage in profile.stages)
    if profile.dp_size <= 1:
        return f"per-stage figures: {ranks} (DP 1: the only data-parallel replica)"
    return f"per-stage figures: {ranks} (of DP {profile.dp_size} replicas, each stage's rank with the highest peak)"


def peak_line(outcomes: list[advice.Outcome]) -> str:
    """Which stage holds the peak today and under the change, in words."""
    if not outcomes:
        return "peak: no stages"
    now = max(outcomes, key=lambda o: o.peak_now_gb)
    then = max(outcomes, key=lambda o: o.peak_gb)
    if now.stage == then.stage:
        return (
            f"peak: stage {now.stage} holds it today ({size_text(now.peak_now_gb)}) and predicted "
            f"({size_text(then.peak_gb)})"
        )
    return (
        f"peak: moves from stage {now.stage} today ({size_text(now.peak_now_gb)}) to stage {then.stage} "
        f"predicted ({size_text(then.peak_gb)})"
    )


@dataclass(frozen=True)
class Advice:
    """What ``advise`` prints, as data: the run, the change, every stage under it, the largest
    micro-batch size that fits (size, how searched), and with ``--fit`` the changes that fit."""

    run: advice.Profile
    changes: list[advice.Change]
    outcomes: list[advice.Outcome]
    best: tuple
    fixes: list[advice.Fix] | None = None
    margin: float = 0.1


def fix_dict(fix: advice.Fix) -> dict:
    """A change that fits, as the JSON of ``advise --fit`` and ``fit``'s alternatives show it."""
    return {"changes": [change.text for change in fix.changes], "peaks_gb": [o.peak_gb for o in fix.outcomes]}


def as_json(advised: Advice) -> str:
    """The contract: {"stages": [{"stage", "now", "predicted", "peak_gb", "capacity_gb", "fits", ...}], ...}.
    Strict JSON: a number that is not finite (NaN, Infinity) is null, and ``null_reasons`` maps where
    it was ("stages[0].peak_gb") to why ("not a finite number: inf")."""
    reasons: dict[str, str] = {}
    document = _as_dict(advised.run, advised.changes, advised.outcomes, advised.best)
    if advised.fixes is not None:
        document["margin"] = advised.margin
        document["fixes"] = [fix_dict(fix) for fix in advised.fixes]
    document = _finite(document, "", reasons)
    document["null_reasons"] = reasons
    return json.dumps(document, indent=1, allow_nan=False)


def _finite(value, where: str, reasons: dict[str, str]):
    """``value`` with every NaN or infinite float made None, and where in ``reasons``."""
    if isinstance(value, float) and not math.isfinite(value):
        reasons[where] = f"not a finite number: {value}"
        return None
    if isinstance(value, dict):
        return {key: _finite(item, f"{where}.{key}" if where else str(key), reasons) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item, f"{where}[{i}]", reasons) for i, item in enumerate(value)]
    return value


def _as_dict(
    profile: advice.Profile, changes: list[advice.Change], outcomes: list[advice.Outcome], best: tuple
) -> dict:
    return dict(
        {
            "changes": [change.text for change in changes],
            "assumptions": outcomes[0].assumptions if outcomes else [],
            "capacity_gb": profile.capacity_gb,
            "capacity_source": profile.capacity_source,
            "pp_size": profile.pp_size,
            "dp_size": profile.dp_size,
            "microbatches": profile.microbatches,
            "micro_batch_size": profile.micro_batch_size,
            "stages": [
                {
                    "stage": outcome.stage,
                    "now": outcome.now,
                    "predicted": outcome.predicted,
                    "in_flight_now": outcome.in_flight_now,
                    "in_flight": outcome.in_flight,
                    "peak_now_gb": outcome.peak_now_gb,
                    "peak_gb": outcome.peak_gb,
                    "peak_low_gb": outcome.peak_low_gb,
                    "peak_high_gb": outcome.peak_high_gb,
                    "capacity_gb": outcome.capacity_gb,
                    "headroom_gb": outcome.headroom_gb,
                    "fits": outcome.fits,
                }
                for outcome in outcomes
            ],
            "fits": all(outcome.fits for outcome in outcomes) if profile.capacity_gb is not None else None,
            "max_micro_batch_size": best[0],
            "max_micro_batch_size_how": best[1],
        }
    )


def as_text(advised: Advice) -> str:
    """Per stage: each part today and predicted, the peak, capacity and headroom; then what fits."""
    run, changes, outcomes = advised.run, advised.changes, advised.outcomes
    what = " + ".join(change.text for change in changes) or "no change (today's figures)"
    lines = [f"what-if: {what}", f"{capacity_line(run)}; PP {run.pp_size}, DP {run.dp_size}", replica_line(run), ""]
    header = f"{'part':<24}" + "".join(f"{'stage ' + str(o.stage):>22}" for o in outcomes)
    lines += [header, f"{'':<24}" + "".join(f"{'now -> predicted':>22}" for _ in outcomes), "-" * len(header)]
    for name in advice.PARTS:
        if all(o.now.get(name) is None for o in outcomes):
            continue
        label = label_of(name, run.gpu)
        cells = [f"{gb_cell(o.now.get(name))} -> {gb_cell(o.predicted.get(name))}" for o in outcomes]
        lines.append(f"{label:<24}" + "".join(f"{c:>22}" for c in cells))
    rows = (
        ("microbatches in flight", [f"{o.in_flight_now} -> {o.in_flight}" for o in outcomes]),
        ("peak", [f"{gb_cell(o.peak_now_gb)} -> {gb_cell(o.peak_gb)}" for o in outcomes]),
        *(
            [("peak range", [f"{gb_cell(o.peak_low_gb)} .. {gb_cell(o.peak_high_gb)}" for o in outcomes])]
            if any(o.peak_range_gb is not None for o in outcomes)
            else []
        ),
        ("headroom", [gb_cell(o.headroom_gb) for o in outcomes]),
        ("fits", ["yes" if o.fits else "NO" if o.fits is not None else "-" for o in outcomes]),
    )
    for label, cells in rows:
        lines.append(f"{label:<24}" + "".join(f"{c:>22}" for c in cells))
    lines += ["", peak_line(outcomes)]
    if outcomes and outcomes[0].assumptions:
        lines += ["", "assumptions:"] + [f"  - {text}" for text in outcomes[0].assumptions]
    size, how = advised.best
    lines.append("")
    under = (
        f" with {' + '.join(c.text for c in changes if c.name != 'micro_batch_size')}"
        if any(c.name != "micro_batch_size" for c in changes)
        else ""
    )
    if size is not None:
        lines.append(
            f"largest micro-batch size that fits on every stage{under}: {size} ({how}; today {run.micro_batch_size})"
        )
    else:
        lines.append(f"largest micro-batch size that fits{under}: not predicted ({how})")
    if advised.fixes is not None:
        lines += ["", *fixes_text(advised.fixes, advised.margin)]
    return "\n".join(map(printable, lines))  # a record's text (a fact, a source) cannot forge a line


def fixes_text(fixes: list[advice.Fix], margin: float) -> list[str]:
    """The changes that fit, cheapest first, each with its predicted peak per stage and its cost."""
    if not fixes:
        return [f"changes that fit with {margin:.0%} free: none predicted (more ranks, or a larger device)"]
    lines = [f"changes that fit with {margin:.0%} of the capacity free, cheapest first:"]
    for number, fix in enumerate(fixes, 1):
        peaks = ", ".join(f"stage {o.stage} {size_text(o.peak_gb)}" for o in fix.outcomes)
        cost = "; ".join(advice.COSTS[c.name] for c in fix.changes if c.name in advice.COSTS)
        lines.append(f"  {number}. {fix.text}: {peaks} ({cost})")
    return lines
