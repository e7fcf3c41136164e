"""What a change would do to each stage's peak: the measurement, moved by arithmetic the user can
check. Pure: no torch, no I/O, no collective. Read by ``nemo-memlog advise`` (offline/advise.py),
the low-headroom warning and the dashboard's ``memory/advice/max_micro_batch_size`` (monitor.py),
and the OOM post-mortem. docs/advise.md states every rule and its measured accuracy.

A stage is its measured parts (``Stage``): parameters, gradients, optimizer state, activations
(``in_flight`` microbatches held at once), temporaries and allocator slack (GPU), and what lies
outside them (GPU: outside the allocator; CPU: the rest of the process's resident memory), with
its layers where the per-layer record has them. ``predict(run, changes)`` applies one combined
change to every stage; ``Change`` values come from ``parse``; a change the record cannot support
raises ``Refused`` saying what is missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: The part names, bottom to top, as the JSON and the picture show them.
PARTS = (
    "params_gb",
    "grads_gb",
    "optimizer_state_gb",
    "activations_gb",
    "temporaries_gb",
    "allocator_slack_gb",
    "outside_gb",
)
MODEL_STATE = ("params_gb", "grads_gb", "optimizer_state_gb")
CHANGES = {
    "micro_batch_size": "N, or xF (a factor of today's): micro_batch_size=4, micro_batch_size=x0.5",
    "microbatches": "N, microbatches per iteration: microbatches=16",
    "layers_per_stage": "a,b,...: transformer layers on each stage, first to last: layers_per_stage=3,5,5,5",
    "distributed_optimizer": "true: optimizer state sharded over data parallelism",
    "recompute": "full or selective",
    "expandable_segments": "true (GPU): PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
}


class Refused(ValueError):
    """A change this run's record cannot predict; the message says what is missing."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage as measured (GB). ``layers``: the per-layer record's rows, or ()."""

    stage: int
    parts: dict
    in_flight: int | None
    chunks: int = 1
    layers: tuple = ()
    rank: int | None = None


@dataclass(frozen=True)
class Run:
    """What the run's record says of the run as a whole."""

    stages: tuple[Stage, ...]
    pp_size: int
    dp_size: int = 1
    microbatches: int | None = None
    micro_batch_size: int | None = None
    optimizer_sharded: bool | None = None
    recompute: str | None = None
    selective_ratio: float | None = None
    gpu: bool = False
    capacity_gb: float | None = None
    capacity_source: str = ""

    @classmethod
    def of(cls, stages, layout: dict, facts: dict, *, gpu: bool, capacity_gb, capacity_source: str = "") -> Run:
        """A run from its stages, its ``layout`` (``pp_size``, ``dp_size``: a per-layer record has
        them) and its ``facts`` (the record's ``"run"``: measure/layer_record.py)."""
        sharded = facts.get("optimizer_sharded") or facts.get("distributed_optimizer")
        return cls(
            stages=tuple(stages),
            pp_size=int(layout.get("pp_size", len(stages))),
            dp_size=int(layout.get("dp_size", 1)),
            microbatches=facts.get("microbatches"),
            micro_batch_size=facts.get("micro_batch_size"),
            optimizer_sharded=bool(sharded) if sharded is not None else None,
            recompute=facts.get("recompute"),
            selective_ratio=facts.get("selective_recompute_ratio"),
            gpu=gpu,
            capacity_gb=capacity_gb,
            capacity_source=capacity_source,
        )


@dataclass(frozen=True)
class Change:
    name: str
    value: Any
    text: str


@dataclass
class Outcome:
    """One stage under a change: today's parts and the predicted ones, in flight, peak and fit."""

    stage: int
    now: dict
    predicted: dict
    in_flight_now: int | None
    in_flight: int | None
    capacity_gb: float | None
    assumptions: list[str] = field(default_factory=list)

    @property
    def peak_now_gb(self) -> float:
        return peak(self.now)

    @property
    def peak_gb(self) -> float:
        return peak(self.predicted)

    @property
    def headroom_gb(self) -> float | None:
        return None if self.capacity_gb is None else self.capacity_gb - self.peak_gb

    @property
    def fits(self) -> bool | None:
        return None if self.capacity_gb is None else self.peak_gb <= self.capacity_gb


def peak(parts: dict) -> float:
    return sum(parts.get(name) or 0.0 for name in PARTS)


def with_model_state(parts: dict) -> dict:
    out = dict(parts)
    out["model_state_gb"] = sum(out.get(name) or 0.0 for name in MODEL_STATE)
    return out


# ---- parsing ---------------------------------------------------------------------------------


def parse(texts) -> list[Change]:
    """``NAME=VALUE`` strings -> Changes (one combined change). ValueError names what to write."""
    changes = []
    for text in texts:
        name, sep, value = text.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in CHANGES:
            known = "; ".join(f"{key}={form}" for key, form in CHANGES.items())
            raise ValueError(f"--what-if {text!r}: expected NAME=VALUE with NAME one of: {known}")
        changes.append(Change(name, _value(name, value, text), text))
    names = [change.name for change in changes]
    if len(set(names)) != len(names):
        raise ValueError(f"--what-if: each change once per combination; got {names}")
    return changes


def _value(name: str, value: str, text: str):
    try:
        if name == "micro_batch_size":
            if value.lower().startswith("x"):
                factor = float(value[1:])
                if factor > 0:
                    return ("x", factor)
            elif int(value) > 0:
                return ("n", int(value))
        elif name == "microbatches" and int(value) > 0:
            return int(value)
        elif name == "layers_per_stage":
            counts = tuple(int(part) for part in value.split(","))
            if all(count >= 0 for count in counts):
                return counts
        elif name in ("distributed_optimizer", "expandable_segments") and value.lower() in ("true", "1", "yes"):
            return True
        elif name == "recompute" and value in ("full", "selective"):
            return value
    except ValueError:
        pass
    raise ValueError(f"--what-if {text!r}: {name} takes {CHANGES[name]}")


# ---- predicting ------------------------------------------------------------------------------


def predict(run: Run, changes: list[Change]) -> list[Outcome]:
    """Every stage under ``changes`` applied together (in the order CHANGES lists them). Raises Refused."""
    state = _State.of(run)
    order = list(CHANGES)
    for change in sorted(changes, key=lambda change: order.index(change.name)):
        _APPLY[change.name](run, state, change)
    return state.outcomes(run)


@dataclass
class _Plan:
    """One stage being changed: its parts, its activations per held microbatch, how many are held."""

    parts: dict
    per_held: float  # activations_gb / in_flight (measured): one held microbatch's share
    in_flight: int | None
    layers: list  # per-layer rows: (kind, params, grads, optimizer, activations/mb, input/mb)


@dataclass
class _State:
    plans: list[_Plan]
    microbatches: int | None
    micro_batch_size: float | None
    assumptions: list[str]

    @classmethod
    def of(cls, run: Run) -> _State:
        plans = []
        for stage in run.stages:
            held = stage.in_flight or 1
            plans.append(
                _Plan(
                    dict(stage.parts),
                    (stage.parts.get("activations_gb") or 0.0) / held,
                    stage.in_flight,
                    [dict(r) for r in stage.layers],
                )
            )
        return cls(plans, run.microbatches, run.micro_batch_size, [])

    def outcomes(self, run: Run) -> list[Outcome]:
        out = []
        for stage, plan in zip(run.stages, self.plans):
            predicted = dict(plan.parts)
            predicted["activations_gb"] = plan.per_held * (plan.in_flight or 1)
            out.append(
                Outcome(
                    stage.stage,
                    with_model_state(stage.parts),
                    with_model_state(predicted),
                    stage.in_flight,
                    plan.in_flight,
                    run.capacity_gb,
                    self.assumptions,
                )
            )
        return out


def _cap(run: Run, stage: Stage) -> int | None:
    """The most microbatches (chunk-forwards) stage ``stage`` can hold: the measured count where the
    schedule limited it (fewer held than run), else 1F1B's PP - s per chunk (at least the measured)."""
    if stage.in_flight is None:
        return None
    if run.microbatches is not None and stage.in_flight < run.microbatches * stage.chunks:
        return stage.in_flight
    return max(stage.in_flight, (run.pp_size - stage.stage) * stage.chunks)


def _in_flight_for(run: Run, state: _State, microbatches: int) -> None:
    for stage, plan in zip(run.stages, state.plans):
        cap = _cap(run, stage)
        if cap is not None:
            plan.in_flight = min(cap, microbatches * stage.chunks)
    state.microbatches = microbatches
    state.assumptions.append(
        "in flight: the schedule's rule, 1F1B: stage s holds min(PP - s, microbatches) microbatches at once "
        "(per model chunk), anchored on the measured count"
    )


def _micro_batch_size(run: Run, state: _State, change: Change) -> None:
    kind, amount = change.value
    if kind == "n":
        if state.micro_batch_size is None:
            raise Refused(
                f"{change.text}: the run's record does not state its micro-batch size; use the relative form "
                f"(micro_batch_size=x{amount}/<today's>), or state it "
                f"(training_log(..., facts={{'micro_batch_size': ...}}))"
            )
        factor = amount / state.micro_batch_size
    else:
        factor = amount
    for plan in state.plans:
        plan.per_held *= factor
        for row in plan.layers:
            row["activations_per_microbatch_gb"] *= factor
            row["input_per_microbatch_gb"] *= factor
    state.assumptions.append(
        f"activations scale with the microbatch's tokens (x{factor:g}); temporaries and slack as measured"
    )
    if state.micro_batch_size is not None:
        state.micro_batch_size *= factor
    if state.microbatches is None:
        state.assumptions.append("microbatches per iteration unknown: the microbatches in flight as measured")
        return
    samples = state.microbatches / factor  # the global batch fixed: fewer, larger microbatches
    if abs(samples - round(samples)) > 1e-9 or round(samples) < 1:
        raise Refused(
            f"{change.text}: with the global batch fixed, {state.microbatches} microbatches become {samples:g}, "
            f"not a whole number; pick a micro-batch size that divides the samples per iteration, or add microbatches=N"
        )
    _in_flight_for(run, state, round(samples))


def _microbatches(run: Run, state: _State, change: Change) -> None:
    if run.microbatches is None and any(stage.in_flight for stage in run.stages):
        state.assumptions.append(
            "today's microbatches per iteration unknown: 1F1B's PP - s taken as each stage's limit"
        )
    _in_flight_for(run, state, change.value)


def _layers_per_stage(run: Run, state: _State, change: Change) -> None:
    counts = change.value
    if len(counts) != run.pp_size:
        raise Refused(f"{change.text}: {len(counts)} counts for {run.pp_size} pipeline stages; give one per stage")
    if not all(_has_layers(stage) for stage in run.stages):
        raise Refused(
            f"{change.text}: the run's record has no per-layer figures for every stage (a run that passed its "
            f"model to training_log or a callback writes them beside the flight record; memory_record_dir must not "
            f"be off)"
        )
    if any(stage.chunks > 1 for stage in run.stages):
        raise Refused(
            f"{change.text}: layer moves are predicted for one model chunk per stage, not interleaved schedules"
        )
    moving = [row for plan in state.plans for row in plan.layers if row["kind"] == "layer"]
    if sum(counts) != len(moving):
        raise Refused(
            f"{change.text}: the counts add up to {sum(counts)}, the run has {len(moving)} transformer layers"
        )
    start = 0
    for plan, count in zip(state.plans, counts):
        fixed = [row for row in plan.layers if row["kind"] != "layer"]
        old_per_mb = sum(row["activations_per_microbatch_gb"] for row in plan.layers)
        mine_before = [row for row in plan.layers if row["kind"] == "layer"]
        mine = moving[start : start + count]
        start += count
        for part in MODEL_STATE:
            plan.parts[part] += sum(row[part] for row in mine) - sum(row[part] for row in mine_before)
        new_per_mb = sum(row["activations_per_microbatch_gb"] for row in fixed + mine)
        plan.per_held = plan.per_held * new_per_mb / old_per_mb if old_per_mb else new_per_mb
        plan.layers = fixed + mine
    state.assumptions.append(
        "layers move whole with their measured parameters, gradients, optimizer state and activations per "
        "microbatch; each stage keeps its microbatches in flight; the embedding, output layer and the rest stay"
    )


def _has_layers(stage: Stage) -> bool:
    """Whether the record found transformer layers (or repeated blocks) on ``stage``, not only "other"."""
    return any(row.get("kind") == "layer" for row in stage.layers)


def _distributed_optimizer(run: Run, state: _State, change: Change) -> None:
    if run.optimizer_sharded:
        raise Refused(f"{change.text}: the optimizer state is already sharded over data parallelism in this run")
    if run.dp_size <= 1:
        raise Refused(
            f"{change.text}: the data-parallel size is 1, so there is nothing to shard the optimizer state over; "
            f"it takes DP >= 2 (more ranks, or fewer pipeline/tensor-parallel ranks)"
        )
    for plan in state.plans:
        plan.parts["optimizer_state_gb"] /= run.dp_size
    state.assumptions.append(
        f"optimizer state and fp32 master copies divided by DP = {run.dp_size} (Megatron's distributed optimizer, "
        f"ZeRO-1); gradients and parameters stay whole"
    )


def _recompute(run: Run, state: _State, change: Change) -> None:
    if run.recompute == change.value:
        raise Refused(f"{change.text}: the run already recomputes ({run.recompute})")
    if not all(_has_layers(stage) for stage in run.stages):
        raise Refused(
            f"{change.text}: the run's record has no per-layer figures (the layers' activations and inputs); "
            f"pass the model to training_log or a callback, with memory_record_dir on"
        )
    if change.value == "selective" and run.selective_ratio is None:
        raise Refused(
            f"{change.text}: cannot be predicted: selective recompute's share comes from Megatron-Bridge 0.6+'s own "
            f"activation formula, which this run's record does not carry (run it with the Megatron-Bridge callback "
            f"on Bridge 0.6+)"
        )
    for plan in state.plans:
        layers = [row for row in plan.layers if row["kind"] == "layer"]
        old = sum(row["activations_per_microbatch_gb"] for row in plan.layers)
        kept = sum(row["activations_per_microbatch_gb"] for row in layers)
        if change.value == "full":
            after = sum(row["input_per_microbatch_gb"] for row in layers)
        else:
            after = kept * run.selective_ratio
        new = old - kept + after
        plan.per_held = plan.per_held * new / old if old else plan.per_held
    if change.value == "full":
        state.assumptions.append("full recompute keeps only each transformer layer's input per microbatch")
    else:
        state.assumptions.append(
            f"selective recompute keeps {run.selective_ratio:.0%} of the layers' activations (Megatron-Bridge's "
            f"formula, calibrated on the measurement)"
        )


def _expandable_segments(run: Run, state: _State, change: Change) -> None:
    if not run.gpu:
        raise Refused(f"{change.text}: a CUDA allocator setting; this run measured no allocator (CPU)")
    for plan in state.plans:
        plan.parts["allocator_slack_gb"] = 0.0
    state.assumptions.append(
        "expandable segments remove the slack between the peaks (bounded below by 0; what rounding keeps is "
        "not predicted)"
    )


_APPLY = {
    "micro_batch_size": _micro_batch_size,
    "microbatches": _microbatches,
    "layers_per_stage": _layers_per_stage,
    "distributed_optimizer": _distributed_optimizer,
    "recompute": _recompute,
    "expandable_segments": _expandable_segments,
}


# ---- what fits -------------------------------------------------------------------------------


def max_micro_batch_size(run: Run) -> tuple[int | None, str]:
    """(the largest micro-batch size whose prediction fits on every stage, how it was searched), or
    (None, why not). With microbatches known, only sizes that keep the global batch whole."""
    if run.capacity_gb is None:
        return None, "no capacity known"
    if run.micro_batch_size is None:
        return None, "the micro-batch size is not in the run's record"
    if any(stage.in_flight is None for stage in run.stages):
        return None, "activations were not measured"
    samples = run.micro_batch_size * run.microbatches if run.microbatches else None
    candidates = (
        [n for n in range(1, samples + 1) if samples % n == 0] if samples else range(1, 64 * run.micro_batch_size + 1)
    )
    best = None
    for size in candidates:
        try:
            outcomes = predict(run, [Change("micro_batch_size", ("n", size), f"micro_batch_size={size}")])
        except Refused:
            continue
        if all(outcome.fits for outcome in outcomes):
            best = size
    how = "sizes dividing the samples per iteration" if samples else "microbatches in flight as measured"
    return best, how


def smallest_fix(run: Run, fraction: float) -> tuple[Change, list[Outcome]] | None:
    """The first change of a short list, least disruptive first, after which every stage keeps at
    least ``fraction`` of its capacity free; None if none does (or nothing can be predicted)."""
    if run.capacity_gb is None:
        return None
    tries = ["expandable_segments=true", "distributed_optimizer=true", "micro_batch_size=x0.5", "recompute=full"]
    tries += ["micro_batch_size=x0.25"]
    for text in tries:
        change = parse([text])
        try:
            outcomes = predict(run, change)
        except Refused:
            continue
        if all((outcome.headroom_gb or 0.0) >= fraction * run.capacity_gb for outcome in outcomes):
            return change[0], outcomes
    return None


def fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * 1000:.1f} MB" if abs(value) < 1 else f"{value:.2f} GB"


# ---- live: from a logging step's unified dict ------------------------------------------------

PREFIX = "memory/"


def stage_parts(figure, gpu: bool) -> dict:
    """One stage's parts (PARTS) from its figures as logged: ``figure(name)`` is a logged name's
    value, or None. GPU: temporaries, slack and the memory outside the allocator as measured; CPU:
    the rest of the process's resident memory (interpreter, libraries, buffers) as ``outside_gb``.
    A figure that is absent or NaN counts as 0."""
    parts = {name: _gb(figure(name)) for name in (*MODEL_STATE, "activations_gb")}
    if gpu:
        parts["temporaries_gb"] = _gb(figure("temporaries_gb"))
        parts["allocator_slack_gb"] = _gb(figure("allocator_slack_gb"))
        parts["outside_gb"] = _gb(figure("device_other_gb"))
    else:
        parts["outside_gb"] = max(_gb(figure("peak_host_rss_gb")) - sum(parts.values()), 0.0)
    return parts


def _gb(value) -> float:
    return float(value) if isinstance(value, (int, float)) and value == value else 0.0


def run_from_unified(unified: dict, facts: dict, layout: dict) -> Run | None:
    """The run as one logging step's unified dict shows it (per-stage keys, no layers), with the
    run's ``facts`` and ``layout`` (pp/dp sizes, local_world_size); None where activations or the
    per-stage parts were not logged."""
    stages, gpu = [], PREFIX + "peak_reserved_gb" in unified
    for stage in range(int(layout.get("pp_size", 1))):
        row = f"{PREFIX}pp_stage_{stage}/"
        if row + "activations_gb" not in unified or row + "params_gb" not in unified:
            return None
        parts = stage_parts(lambda name, row=row: unified.get(row + name), gpu)
        in_flight = unified.get(row + "microbatches_in_flight")
        stages.append(Stage(stage, parts, int(in_flight) if in_flight is not None else None))
    if gpu:
        capacity = unified.get(PREFIX + "device_total_gb")
    else:
        total = unified.get(PREFIX + "host_limit_gb") or unified.get(PREFIX + "host_total_gb")
        capacity = total / max(int(layout.get("local_world_size", 1)), 1) if total else None
    return Run.of(stages, layout, facts, gpu=gpu, capacity_gb=capacity)


def fix_sentence(run: Run, fraction: float) -> str:
    """The low-headroom warning's advice: the smallest listed change that leaves every stage
    ``fraction`` of its capacity free, with the predicted figure; or that none of them does."""
    found = smallest_fix(run, fraction)
    if found is None:
        return (
            f" No change nemo-memlog advise predicts alone (expandable segments, the distributed optimizer, "
            f"half or a quarter of the micro-batch, full recompute) leaves {fraction:.0%} free on every stage."
        )
    change, outcomes = found
    worst = max(outcomes, key=lambda outcome: outcome.peak_now_gb)
    return (
        f" The smallest listed change that restores it: {change.text} (predicted: stage {worst.stage}'s peak "
        f"{fmt(worst.peak_now_gb)} -> {fmt(worst.peak_gb)} of {fmt(worst.capacity_gb)}; `nemo-memlog advise` "
        f"on the run folder shows every stage)."
    )


def would_have_fit(run: Run) -> list[tuple[str, float]]:
    """(change, predicted peak GB) for each listed change after which every stage fits its capacity."""
    fits = []
    for text in ("expandable_segments=true", "distributed_optimizer=true", "micro_batch_size=x0.5", "recompute=full"):
        try:
            outcomes = predict(run, parse([text]))
        except Refused:
            continue
        if all(outcome.fits for outcome in outcomes):
            fits.append((text, max(outcome.peak_gb for outcome in outcomes)))
    return fits


def oom_run(report: dict, oom: dict, record: dict | None) -> Run | None:
    """The failing rank at a CUDA OOM as a one-stage Run: its breakdown (``report``, from the OOM
    record), the request it could not serve added to its temporaries, the device's limit as the
    capacity; the run's facts and sizes from its per-layer ``record`` where there is one."""
    parts = {name: report.get(name) for name in (*MODEL_STATE, "activations_gb")}
    if any(not isinstance(value, (int, float)) or value != value for value in parts.values()):
        return None
    parts = stage_parts(report.get, gpu=True)
    parts["temporaries_gb"] += (oom.get("bytes_requested") or 0) / 1e9
    record = record or {}
    facts = record.get("run", {})
    in_flight = report.get("microbatches_in_flight")
    stage = Stage(int(record.get("pp_rank", 0)), parts, int(in_flight) if isinstance(in_flight, int) else None)
    limit = oom.get("device_limit")
    return Run.of((stage,), record, facts, gpu=True, capacity_gb=limit / 1e9 if limit else None)
