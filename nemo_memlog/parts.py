"""The parts a stage's memory is made of, defined once: their logged names, units and labels.

Each ``Part`` says what the settings' default per-stage keys, the measurement, the per-layer
record, the advice, the writers and the offline commands read of it. No torch: the offline
commands read it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Source(Enum):
    """Where a part's figure comes from."""

    MODEL_STATE = "model_state"  # counted from the model and optimizer (measure/composition.py)
    STEP = "step"  # a logging step's breakdown: the activation meter and the allocator's peaks
    REPORT = "report"  # rank/memory.py's report: what the measured parts leave of the peak


@dataclass(frozen=True)
class Part:
    """One part of a stage's memory.

    Args:
        key: its name in the logged metrics (``memory/pp_stage_{i}/<key>``) and the records.
        unit: "GB", or "count" for a number of microbatches.
        label: the one name every output shows it under (tables, PNGs, docs); None: the key.
        per_stage: logged per pipeline stage by default (the settings' ``memory_per_stage_keys``).
        advised: a part of the stage's peak that ``nemo-memlog advise`` predicts under a change.
        source: where its figure comes from.
    """

    key: str
    unit: str
    label: str | None
    per_stage: bool
    advised: bool
    source: Source


GB, COUNT = "GB", "count"

PARAMS = Part("params_gb", GB, "parameters", True, True, Source.MODEL_STATE)
GRADS = Part("grads_gb", GB, "gradients", True, True, Source.MODEL_STATE)
OPTIMIZER_STATE = Part("optimizer_state_gb", GB, "optimizer state", True, True, Source.MODEL_STATE)
MODEL_STATE_TOTAL = Part("model_state_gb", GB, None, True, False, Source.MODEL_STATE)
ACTIVATIONS = Part("activations_gb", GB, "activations", True, True, Source.STEP)
ACTIVATIONS_PER_MICROBATCH = Part("activations_per_microbatch_gb", GB, None, True, False, Source.STEP)
IN_FLIGHT = Part("microbatches_in_flight", COUNT, None, True, False, Source.STEP)
TEMPORARIES = Part("temporaries_gb", GB, "temporaries", True, True, Source.STEP)
ALLOCATOR_SLACK = Part("allocator_slack_gb", GB, "allocator slack", True, True, Source.STEP)
#: What the measured parts leave of the stage's peak: on a GPU the device memory outside the
#: caching allocator (logged as ``device_other_gb``), on CPU the rest of the process's resident
#: memory (interpreter, libraries, buffers). Its label depends on the platform (``label_of``).
OUTSIDE = Part("outside_gb", GB, None, True, True, Source.REPORT)
#: The names the outside part goes by: in the advice, as logged, and in the composition picture.
OUTSIDE_KEYS = ("outside_gb", "device_other_gb", "rest_of_process_gb")
OUTSIDE_GPU = "outside the allocator"
OUTSIDE_CPU = "rest of the process"

#: Every part, bottom to top as the pictures stack them.
PARTS = (
    PARAMS,
    GRADS,
    OPTIMIZER_STATE,
    MODEL_STATE_TOTAL,
    ACTIVATIONS,
    ACTIVATIONS_PER_MICROBATCH,
    IN_FLIGHT,
    TEMPORARIES,
    ALLOCATOR_SLACK,
    OUTSIDE,
)

#: The model state's figures as report_model_state returns them (the three parts and their sum).
MODEL_STATE_KEYS = tuple(p.key for p in PARTS if p.source is Source.MODEL_STATE)
#: The three parts the model state is made of.
MODEL_STATE_PARTS = tuple(p.key for p in PARTS if p.source is Source.MODEL_STATE and p.advised)
#: What a logging step's breakdown adds to the report (measure/composition.breakdown).
STEP_KEYS = tuple(p.key for p in PARTS if p.source is Source.STEP)
#: The parts of a stage's peak the advice predicts, bottom to top, as its JSON and picture show them.
ADVISED_KEYS = tuple(p.key for p in PARTS if p.advised)
#: The parts logged per stage by default, besides rank/memory.py's own figures.
PER_STAGE_KEYS = tuple(p.key for p in PARTS if p.per_stage and p.source is not Source.REPORT)
#: The one name of each labelled part, in every output (tables, PNGs, docs).
LABELS = {p.key: p.label for p in PARTS if p.label is not None}


def label_of(key: str, gpu: bool) -> str:
    """The one name of a part in every output; the outside part's by platform; else the key itself.

    Args:
        key: a part's key (or one of the names the outside part goes by, ``OUTSIDE_KEYS``).
        gpu: whether the run measured a CUDA device (else the host's memory).
    """
    if key in OUTSIDE_KEYS:
        return OUTSIDE_GPU if gpu else OUTSIDE_CPU
    return LABELS.get(key, key)
