"""The words of the advice: a stage's measured parts (``Stage``), the run's measurement
(``Profile``), a change (``Change``, from ``parse``) and a predicted stage (``Outcome``).
Pure: no torch, no I/O."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..parts import ADVISED_KEYS, MODEL_STATE_PARTS
from ..units import size_text

#: The part names, bottom to top, as the JSON and the picture show them.
PARTS = ADVISED_KEYS
MODEL_STATE = MODEL_STATE_PARTS
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
class Node:
    """The ranks of a node that share one memory cgroup, judged as the kernel charges them: the
    cgroup's peak charge (shared pages once) against its limit, in GB. ``stages``: each of its
    ranks' pipeline stage, one entry a rank (a stage's predicted change counts once per rank)."""

    name: str
    limit_gb: float
    charge_gb: float
    stages: tuple[int, ...]


@dataclass(frozen=True)
class Profile:
    """One run's memory profile, as advice reads it from the records: each stage's parts and
    microbatches in flight, and the facts of the run as a whole (not the activation meter's
    ``measure.activations.Measurement``, one rank's iteration)."""

    stages: tuple[Stage, ...]
    pp_size: int
    dp_size: int = 1
    microbatches: int | None = None
    micro_batch_size: int | None = None
    optimizer_sharded: bool | None = None
    recompute: str | None = None
    schedule: str | None = None  # stated; else inferred (predict.schedule_name)
    microbatch_group: int | None = None  # Megatron's microbatch_group_size_per_vp_stage, where stated
    selective_ratio: float | None = None
    gpu: bool = False
    capacity_gb: float | None = None
    capacity_source: str = ""
    #: Per stage, the exponent p of the temporaries' growth with the micro-batch size (x F: x F**p),
    #: from two runs at two sizes (``growth_between``); None: 1, in proportion.
    temporaries_growth: tuple[float, ...] | None = None
    #: The nodes whose ranks share a memory cgroup (offline/node_charge.py): where given, whether a
    #: stage fits is its nodes' charge plus each of their ranks' predicted change against the limit.
    nodes: tuple[Node, ...] = ()

    @classmethod
    def of(
        cls,
        stages: Sequence[Stage],
        layout: dict,
        facts: dict,
        *,
        gpu: bool,
        capacity_gb: float | None,
        capacity_source: str = "",
    ) -> Profile:
        """The measurement from the run's stages, its ``layout`` (``pp_size``, ``dp_size``: a per-layer record has
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
            schedule=facts.get("schedule"),
            microbatch_group=facts.get("microbatch_group_size_per_vp_stage"),
            selective_ratio=facts.get("selective_recompute_ratio"),
            gpu=gpu,
            capacity_gb=capacity_gb,
            capacity_source=capacity_source,
        )


#: The exponents ``growth_between`` gives are kept in [0, MAX_GROWTH]: measurement noise between two
#: close sizes must not make a steeper rule than the tokens' (1) by much, nor a falling one.
MAX_GROWTH = 1.5


#: Parameters per stage differing by more than this share make two runs two models.
SAME_PARAMS_SHARE = 0.02


def global_batch(profile: Profile) -> int | None:
    """Samples per iteration: micro-batch size x microbatches x data-parallel size, where known."""
    if not profile.micro_batch_size or not profile.microbatches:
        return None
    return profile.micro_batch_size * profile.microbatches * profile.dp_size


def job_difference(first: Profile, second: Profile) -> str | None:
    """What makes ``second`` another job than ``first`` (only the micro-batch size, and with it the
    microbatches, may differ): the first fact or figure that differs, in words; None when none does.
    Facts a record does not state are not compared."""
    if first.pp_size != second.pp_size or len(first.stages) != len(second.stages):
        return f"pipeline size {first.pp_size} vs {second.pp_size} ({len(first.stages)} vs {len(second.stages)} stages)"
    if first.dp_size != second.dp_size:
        return f"data-parallel size {first.dp_size} vs {second.dp_size}"
    batches = global_batch(first), global_batch(second)
    if None not in batches and batches[0] != batches[1]:
        return (
            f"global batch size {batches[0]} vs {batches[1]} (micro-batch size x microbatches x data-parallel size: "
            f"{first.micro_batch_size} x {first.microbatches} x {first.dp_size} vs "
            f"{second.micro_batch_size} x {second.microbatches} x {second.dp_size})"
        )
    for a, b in zip(first.stages, second.stages):
        p1, p2 = a.parts.get("params_gb"), b.parts.get("params_gb")
        if p1 is not None and p2 is not None and abs(p1 - p2) > SAME_PARAMS_SHARE * max(p1, p2):
            return f"parameters on stage {a.stage} {size_text(p1)} vs {size_text(p2)}"
    for name in ("optimizer_sharded", "recompute"):
        v1, v2 = getattr(first, name), getattr(second, name)
        if v1 is not None and v2 is not None and v1 != v2:
            return f"{name} {v1} vs {v2}"
    return None


def growth_between(first: Profile, second: Profile) -> tuple[float, ...]:
    """Per stage, the exponent p with which the temporaries grew from ``first``'s micro-batch size to
    ``second``'s: T2 / T1 = (s2 / s1) ** p, kept in [0, MAX_GROWTH]; 1 where a stage's temporaries
    were not measured in both. Raises ValueError for runs of other layouts or without two sizes
    (``job_difference`` says whether they are one job at all: ``advise --calibrate-with`` asks it)."""
    s1, s2 = first.micro_batch_size, second.micro_batch_size
    if not s1 or not s2 or s1 == s2:
        raise ValueError(f"two runs at two micro-batch sizes are needed (got {s1} and {s2})")
    if len(first.stages) != len(second.stages):
        raise ValueError(f"the runs have {len(first.stages)} and {len(second.stages)} pipeline stages")
    growth = []
    for a, b in zip(first.stages, second.stages):
        t1, t2 = a.parts.get("temporaries_gb") or 0.0, b.parts.get("temporaries_gb") or 0.0
        if t1 <= 0 or t2 <= 0:
            growth.append(1.0)
        else:
            growth.append(min(max(math.log(t2 / t1) / math.log(s2 / s1), 0.0), MAX_GROWTH))
    return tuple(growth)


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
    #: (low, high) where one run cannot tell a part's scaling (the temporaries under a micro-batch change).
    peak_range_gb: tuple[float, float] | None = None
    #: Under a shared memory cgroup: the room its limit leaves the stage's node(s) under the change
    #: (limit - peak charge - the node's ranks' predicted changes; the least over the stage's
    #: nodes), and that limit. None: judged per rank against ``capacity_gb``.
    node_room_gb: float | None = None
    node_limit_gb: float | None = None

    @property
    def peak_now_gb(self) -> float:
        return peak(self.now)

    @property
    def peak_gb(self) -> float:
        return peak(self.predicted)

    @property
    def peak_low_gb(self) -> float:
        return self.peak_gb if self.peak_range_gb is None else min(self.peak_range_gb)

    @property
    def peak_high_gb(self) -> float:
        """The top of the range: what the headroom and the fit are judged by (under-prediction crashes jobs)."""
        return self.peak_gb if self.peak_range_gb is None else max(self.peak_range_gb)

    @property
    def headroom_gb(self) -> float | None:
        if self.node_room_gb is not None:
            return self.node_room_gb
        return None if self.capacity_gb is None else self.capacity_gb - self.peak_high_gb

    @property
    def fits(self) -> bool | None:
        return self.fits_with()

    def fits_with(self, margin: float = 0.0, slack: float = 1.0) -> bool | None:
        """Whether what the stage uses (its peak, the range's top; under a shared cgroup its node's
        charge) stays within ``(1 - margin) * slack`` of its capacity (per rank, or the node's limit);
        None unknown."""
        basis = self.node_limit_gb if self.node_room_gb is not None else self.capacity_gb
        headroom = self.headroom_gb
        if basis is None or headroom is None:
            return None
        return basis - headroom <= basis * (1.0 - margin) * slack


def peak(parts: dict) -> float:
    return sum(parts.get(name) or 0.0 for name in PARTS)


def with_model_state(parts: dict) -> dict:
    out = dict(parts)
    out["model_state_gb"] = sum(out.get(name) or 0.0 for name in MODEL_STATE)
    return out


# ---- parsing ---------------------------------------------------------------------------------


def parse(texts: Iterable[str]) -> list[Change]:
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


def fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return size_text(value)
