"""Applying a change to every stage (``predict``), and what fits (``max_micro_batch_size``,
``smallest_fix``). Pure arithmetic over the measured parts; docs/advise.md states each rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .model import CHANGES, MODEL_STATE, Change, Outcome, Profile, Refused, Stage, parse, peak, with_model_state

# ---- predicting ------------------------------------------------------------------------------


def predict(profile: Profile, changes: list[Change]) -> list[Outcome]:
    """Every stage under ``changes`` applied together (in the order CHANGES lists them). Raises Refused."""
    state = _State.of(profile)
    order = list(CHANGES)
    for change in sorted(changes, key=lambda change: order.index(change.name)):
        _APPLY[change.name](profile, state, change)
    return state.outcomes(profile)


@dataclass
class _Plan:
    """One stage being changed: its parts, its activations per held microbatch, how many are held."""

    parts: dict
    per_held: float  # activations_gb / in_flight (measured): one held microbatch's share
    in_flight: int | None
    layers: list  # per-layer rows: (kind, params, grads, optimizer, activations/mb, input/mb)
    temporaries_range: tuple[float, float] | None = None  # where one run cannot tell how they scale
    keeps_top: bool = False  # a range wider than MAX_RANGE is cut at its bottom (else at its far end)


@dataclass
class _State:
    plans: list[_Plan]
    microbatches: int | None
    micro_batch_size: float | None
    assumptions: list[str]

    @classmethod
    def of(cls, profile: Profile) -> _State:
        plans = []
        for stage in profile.stages:
            held = stage.in_flight or 1
            plans.append(
                _Plan(
                    dict(stage.parts),
                    (stage.parts.get("activations_gb") or 0.0) / held,
                    stage.in_flight,
                    [dict(r) for r in stage.layers],
                )
            )
        return cls(plans, profile.microbatches, profile.micro_batch_size, [])

    def outcomes(self, profile: Profile) -> list[Outcome]:
        out = self._per_stage(profile)
        change = {outcome.stage: outcome.peak_gb - outcome.peak_now_gb for outcome in out}
        for node in profile.nodes:  # the node's charge plus each of its ranks' change: shared pages once
            room = node.limit_gb - node.charge_gb - sum(change.get(stage, 0.0) for stage in node.stages)
            for outcome in out:
                if outcome.stage in node.stages and (outcome.node_room_gb is None or room < outcome.node_room_gb):
                    outcome.node_room_gb, outcome.node_limit_gb = room, node.limit_gb
        return out

    def _per_stage(self, profile: Profile) -> list[Outcome]:
        out = []
        for stage, plan in zip(profile.stages, self.plans):
            predicted = dict(plan.parts)
            predicted["activations_gb"] = plan.per_held * (plan.in_flight or 1)
            bounds = None
            if plan.temporaries_range is not None:
                bounds = _bounds(predicted, plan)
            out.append(
                Outcome(
                    stage.stage,
                    with_model_state(stage.parts),
                    with_model_state(predicted),
                    stage.in_flight,
                    plan.in_flight,
                    profile.capacity_gb,
                    self.assumptions,
                    peak_range_gb=bounds,
                )
            )
        return out


def _bounds(predicted: dict, plan: _Plan) -> tuple[float, float]:
    """The stage's peak range from its temporaries' range, at most MAX_RANGE wide: cut at its far end
    from the prediction, or (``keeps_top``: one run on a GPU, judged by the top, as under-prediction
    crashes jobs) at its bottom, the prediction (``predicted``, changed in place) brought within."""
    assert plan.temporaries_range is not None
    low, high = (peak({**predicted, "temporaries_gb": value}) for value in plan.temporaries_range)
    if high > MAX_RANGE * low:
        if plan.keeps_top:
            low = high / MAX_RANGE
        else:
            high = MAX_RANGE * low
    shortfall = low - peak(predicted)
    if shortfall > 0:
        predicted["temporaries_gb"] = (predicted.get("temporaries_gb") or 0.0) + shortfall
    return (low, high)


#: The pipeline schedules whose microbatches in flight are known (Megatron's warm-up counts).
SCHEDULES = {
    "1f1b": "one model chunk per stage: stage s holds min(PP - s, microbatches) microbatches",
    "interleaved": (
        "virtual pipeline (V chunks per stage): stage s holds warm-up + 1 chunk-forwards, warm-up = "
        "(PP - s - 1)·2 + (V - 1)·group (group: microbatch_group_size_per_vp_stage, PP by default), "
        "at most microbatches·V"
    ),
}


def schedule_name(profile: Profile) -> str:
    """The run's pipeline schedule: its stated fact, else "interleaved" for several chunks per stage,
    else "1f1b". Raises Refused for a stated schedule whose rule is not known (never guessed)."""
    stated = profile.schedule
    if stated is None:
        return "interleaved" if any(stage.chunks > 1 for stage in profile.stages) else "1f1b"
    name = str(stated).lower().replace("-", "").replace("_", "")
    if name not in SCHEDULES:
        raise Refused(
            f"the run's pipeline schedule {stated!r} has no known rule for the microbatches in flight (known: "
            f"{', '.join(SCHEDULES)}); the change cannot be predicted for it"
        )
    return name


def in_flight(schedule: str, pp_size: int, stage: int, chunks: int, microbatches: int, group: int | None = None) -> int:
    """The chunk-forwards stage ``stage`` holds at once under ``schedule`` (SCHEDULES) with
    ``microbatches`` per iteration: Megatron's warm-up count (get_pp_rank_microbatches), plus the one
    forward of the steady state, or every chunk-forward where all of them are warm-up."""
    total = microbatches * chunks
    if pp_size <= 1:
        return min(1, total)
    if schedule == "interleaved":
        warmup = (pp_size - stage - 1) * 2 + (chunks - 1) * (group or pp_size)
    else:
        warmup = pp_size - stage - 1
    return total if warmup >= total else warmup + 1


def _in_flight_for(profile: Profile, state: _State, microbatches: int) -> None:
    if profile.microbatches is None:  # today's count unknown: the measured count as each stage's limit
        for stage, plan in zip(profile.stages, state.plans):
            if stage.in_flight is not None:
                cap = max(stage.in_flight, (profile.pp_size - stage.stage) * stage.chunks)
                plan.in_flight = min(cap, microbatches * stage.chunks)
        state.microbatches = microbatches
        return
    schedule = schedule_name(profile)
    for stage, plan in zip(profile.stages, state.plans):
        if stage.in_flight is None:
            continue
        rule = in_flight(
            schedule, profile.pp_size, stage.stage, stage.chunks, profile.microbatches, profile.microbatch_group
        )
        if rule != stage.in_flight:
            raise Refused(
                f"stage {stage.stage} held {stage.in_flight} microbatches at once where the {schedule} schedule holds "
                f"{rule} with {profile.microbatches} microbatches: the run's schedule is not {schedule} as recorded; "
                f"state it (training_log(..., facts={{'schedule': ...}}), one of {', '.join(SCHEDULES)}), or check "
                f"the recorded microbatches"
            )
        plan.in_flight = in_flight(
            schedule, profile.pp_size, stage.stage, stage.chunks, microbatches, profile.microbatch_group
        )
    state.microbatches = microbatches
    state.assumptions.append(f"in flight: the {schedule} schedule's rule, {SCHEDULES[schedule]}; it matched the run")


def _micro_batch_size(profile: Profile, state: _State, change: Change) -> None:
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
    growth = profile.temporaries_growth or (1.0,) * len(state.plans)
    host_rule = False
    for plan, power in zip(state.plans, growth):
        layer_working_set = max((row["activations_per_microbatch_gb"] for row in plan.layers), default=0.0)
        plan.per_held *= factor
        for row in plan.layers:
            row["activations_per_microbatch_gb"] *= factor
            row["input_per_microbatch_gb"] *= factor
        today = plan.parts.get("temporaries_gb")
        if today and not profile.temporaries_growth and not profile.gpu and layer_working_set > 0:
            plan.parts["temporaries_gb"] = _host_temporaries(today, layer_working_set, factor)
            far = today * factor if factor > 1 else today  # the other rule: in proportion, or held
            point = plan.parts["temporaries_gb"]
            plan.temporaries_range = (min(point, far), max(point, far))
            host_rule = True
        elif today:
            plan.parts["temporaries_gb"] = today * factor**power
            if not profile.temporaries_growth:  # one run: x1 (they do not scale) to x factor (they do), both hold
                plan.temporaries_range = (min(today, today * factor), max(today, today * factor))
                plan.keeps_top = True
    if profile.temporaries_growth:
        powers = ", ".join(f"{power:.2f}" for power in growth)
        grows = f"the temporaries x{factor:g}**p, p per stage from two runs at two sizes: {powers}"
    elif host_rule:
        grows = (
            "the host's temporaries (the process's peak beyond its idle size, the model state and the activations) "
            + (
                f"gain one layer's working set per added share ({LAYER_WORKING_SET:g}x its largest layer's "
                f"activations per microbatch, x{factor - 1:g}: what the allocator already holds is reused)"
                if factor > 1
                else f"shrink in proportion (x{factor:g})"
            )
            + f"; the range reaches toward x{factor:g} of them, at most {MAX_RANGE:g}x wide "
            "(--calibrate-with a second run measures their growth)"
        )
    else:
        grows = (
            f"so do the temporaries (the working set of the microbatch being computed, x{factor:g}); one run "
            f"cannot tell how far, so the peak is a range from x1 to x{factor:g} of them, judged by its top "
            f"(--calibrate-with a second run narrows it)"
        )
    state.assumptions.append(
        f"activations scale with the microbatch's tokens (x{factor:g}); {grows}; the rest as measured"
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
    _in_flight_for(profile, state, round(samples))


#: A predicted peak's range is at most this wide (``peak_high_gb / peak_low_gb``): wider says nothing.
MAX_RANGE = 1.25


#: The working set one layer adds at the peak, per added share of the micro-batch, in its measured
#: activations per microbatch (``_host_temporaries``): 1.5 keeps the change's error smallest over the two
#: regimes measured (docs/advise.md: +17% at most where activations dominate, -22% where they do not).
LAYER_WORKING_SET = 1.5


def _host_temporaries(today: float, layer_gb: float, factor: float) -> float:
    """A CPU stage's temporaries under a micro-batch size x ``factor``, from one run (``layer_gb``: its
    largest layer's activations per microbatch). Measured on megatron-core's GPT under 1F1B, PP 2
    (docs/advise.md), the host's temporaries shrank in proportion at x0.5 (x0.49, x0.55 per stage)
    but grew at x2 by about one to two layers' working set, not in proportion (x1.15 and x1.39 where
    activations dominate, x1.42 and x1.69 where they do not): the blocks the allocator already holds
    are reused by the larger microbatch (tensors past glibc's mmap threshold are returned at once),
    and what it adds is the layer being computed, grown."""
    if factor <= 1:
        return today * factor
    return min(today + LAYER_WORKING_SET * layer_gb * (factor - 1), today * factor)


def _microbatches(profile: Profile, state: _State, change: Change) -> None:
    if profile.microbatches is None and any(stage.in_flight for stage in profile.stages):
        state.assumptions.append(
            "today's microbatches per iteration unknown: 1F1B's PP - s taken as each stage's limit"
        )
    _in_flight_for(profile, state, change.value)


def _layers_per_stage(profile: Profile, state: _State, change: Change) -> None:
    counts = change.value
    if len(counts) != profile.pp_size:
        raise Refused(f"{change.text}: {len(counts)} counts for {profile.pp_size} pipeline stages; give one per stage")
    if not all(_has_layers(stage) for stage in profile.stages):
        raise Refused(
            f"{change.text}: the run's record has no per-layer figures for every stage (a run that passed its "
            f"model to training_log or a callback writes them beside the flight record; memory_record_dir must not "
            f"be off)"
        )
    if any(stage.chunks > 1 for stage in profile.stages):
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


def _distributed_optimizer(profile: Profile, state: _State, change: Change) -> None:
    if profile.optimizer_sharded:
        raise Refused(f"{change.text}: the optimizer state is already sharded over data parallelism in this run")
    if profile.dp_size <= 1:
        raise Refused(
            f"{change.text}: the data-parallel size is 1, so there is nothing to shard the optimizer state over; "
            f"it takes DP >= 2 (more ranks, or fewer pipeline/tensor-parallel ranks)"
        )
    for plan in state.plans:
        plan.parts["optimizer_state_gb"] /= profile.dp_size
    state.assumptions.append(
        f"optimizer state and fp32 master copies divided by DP = {profile.dp_size} (Megatron's distributed optimizer, "
        f"ZeRO-1); gradients and parameters stay whole"
    )


def _recompute(profile: Profile, state: _State, change: Change) -> None:
    if profile.recompute == change.value:
        raise Refused(f"{change.text}: the run already recomputes ({profile.recompute})")
    if not all(_has_layers(stage) for stage in profile.stages):
        raise Refused(
            f"{change.text}: the run's record has no per-layer figures (the layers' activations and inputs); "
            f"pass the model to training_log or a callback, with memory_record_dir on"
        )
    if change.value == "selective" and profile.selective_ratio is None:
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
            after = kept * profile.selective_ratio
        new = old - kept + after
        plan.per_held = plan.per_held * new / old if old else plan.per_held
    if change.value == "full":
        state.assumptions.append("full recompute keeps only each transformer layer's input per microbatch")
    else:
        state.assumptions.append(
            f"selective recompute keeps {profile.selective_ratio:.0%} of the layers' activations (Megatron-Bridge's "
            f"formula, calibrated on the measurement)"
        )


def _expandable_segments(profile: Profile, state: _State, change: Change) -> None:
    if not profile.gpu:
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


#: Up to this many candidate sizes each one is predicted; above it (a stated micro-batch size or
#: microbatch count in the millions), a bisection finds the same size: a stage's predicted peak never
#: falls as the micro-batch grows (its activations are the size times the microbatches in flight, and
#: with the global batch fixed those never grow with it), so the sizes that fit are the smallest ones.
_PREDICT_EACH = 64  # the live advice runs at every logging step: a few predictions, not thousands
#: Trial division up to this factor, so that any stated count factors in bounded time; a cofactor left
#: above it is taken whole (some of its divisors may go untried: the answer still fits).
_TRIAL_DIVISOR = 1 << 20
#: More sizes than this dividing the samples per iteration are not searched.
MAX_DIVISORS = 1 << 20


def max_micro_batch_size(
    profile: Profile, changes: Sequence[Change] = (), margin: float = 0.0
) -> tuple[int | None, str]:
    """(the largest micro-batch size whose prediction, with ``changes`` other than the micro-batch
    size applied too, leaves ``margin`` of the capacity free on every stage; how it was searched),
    or (None, why not). With microbatches known, only sizes that keep the global batch whole.
    Bounded: about 40 predictions whatever the run's stated sizes (see _PREDICT_EACH)."""
    if profile.capacity_gb is None:
        return None, "no capacity known"
    if profile.micro_batch_size is None:
        return None, "the micro-batch size is not in the run's record"
    if any(stage.in_flight is None for stage in profile.stages):
        return None, "activations were not measured"
    if not _whole(profile.micro_batch_size) or (profile.microbatches is not None and not _whole(profile.microbatches)):
        return None, "the micro-batch size or microbatches in the run's record is not a whole number above 0"
    samples = profile.micro_batch_size * profile.microbatches if profile.microbatches else None
    how = "sizes dividing the samples per iteration" if samples else "microbatches in flight as measured"
    if samples and profile.microbatches:
        candidates = divisors(profile.micro_batch_size, profile.microbatches)
        if candidates is None:
            return None, f"more than {MAX_DIVISORS} sizes divide the samples per iteration ({samples}): not searched"
        count = len(candidates)
    else:
        count = 64 * profile.micro_batch_size
        candidates = None

    def size_at(index: int) -> int:
        return candidates[index] if candidates is not None else index + 1

    others = [change for change in changes if change.name != "micro_batch_size"]

    def fits(size: int) -> bool:
        try:
            outcomes = predict(profile, [*others, Change("micro_batch_size", ("n", size), f"micro_batch_size={size}")])
        except Refused:
            return False
        return all(outcome.fits_with(margin) for outcome in outcomes)

    if count <= _PREDICT_EACH:  # every candidate, as the rule reads
        best = None
        for index in range(count):
            if fits(size_at(index)):
                best = size_at(index)
        return best, how
    if not fits(size_at(0)):
        return None, how
    low, high = 0, count - 1  # size_at(low) fits; find the last index that does
    while low < high:
        middle = (low + high + 1) // 2
        if fits(size_at(middle)):
            low = middle
        else:
            high = middle - 1
    return size_at(low), how


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def divisors(*numbers: int) -> list[int] | None:
    """Every divisor of the product of ``numbers``, ascending, from each one's factors (trial division
    up to _TRIAL_DIVISOR, a larger cofactor taken whole: the micro-batch size and the microbatches are
    factored apart, each at most 2**20 when stated through training_log, so a few hundred divisions);
    None where there are more than MAX_DIVISORS."""
    factors: dict[int, int] = {}
    for number in numbers:
        rest, divisor = number, 2
        while divisor * divisor <= rest and divisor <= _TRIAL_DIVISOR:
            while rest % divisor == 0:
                factors[divisor] = factors.get(divisor, 0) + 1
                rest //= divisor
            divisor += 1 if divisor == 2 else 2
        if rest > 1:
            factors[rest] = factors.get(rest, 0) + 1
    count = 1
    for power in factors.values():
        count *= power + 1
    if count > MAX_DIVISORS:
        return None
    divisors = [1]
    for prime, power in factors.items():
        divisors = [d * prime**k for d in divisors for k in range(power + 1)]
    return sorted(divisors)


def smallest_fix(profile: Profile, fraction: float) -> tuple[Change, list[Outcome]] | None:
    """The first change of a short list, least disruptive first, after which every stage keeps at
    least ``fraction`` of its capacity free; None if none does (or nothing can be predicted)."""
    if profile.capacity_gb is None:
        return None
    tries = ["expandable_segments=true", "distributed_optimizer=true", "micro_batch_size=x0.5", "recompute=full"]
    tries += ["micro_batch_size=x0.25"]
    for text in tries:
        change = parse([text])
        try:
            outcomes = predict(profile, change)
        except Refused:
            continue
        if all(outcome.fits_with(fraction) for outcome in outcomes):
            return change[0], outcomes
    return None
