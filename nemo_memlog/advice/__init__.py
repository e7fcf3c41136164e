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

Four modules: ``model`` (the words), ``predict`` (the arithmetic of a change, and the largest
micro-batch size that fits), ``search`` (the changes that fit, cheapest first), ``live`` (the
advice read from a logging step and at an OOM).
"""

from .live import PREFIX, fix_sentence, oom_run, run_from_unified, stage_parts, would_have_fit
from .model import (
    CHANGES,
    MODEL_STATE,
    PARTS,
    Change,
    Outcome,
    Refused,
    Run,
    Stage,
    fmt,
    growth_between,
    parse,
    peak,
    with_model_state,
)
from .predict import MAX_DIVISORS, divisors, max_micro_batch_size, predict, schedule_name, smallest_fix
from .search import COSTS, Fix, balanced_split, changes_that_fit

__all__ = [
    "CHANGES",
    "COSTS",
    "MAX_DIVISORS",
    "divisors",
    "Fix",
    "balanced_split",
    "changes_that_fit",
    "Change",
    "MODEL_STATE",
    "Outcome",
    "PARTS",
    "PREFIX",
    "Refused",
    "Run",
    "Stage",
    "fix_sentence",
    "fmt",
    "growth_between",
    "max_micro_batch_size",
    "oom_run",
    "parse",
    "peak",
    "predict",
    "schedule_name",
    "run_from_unified",
    "smallest_fix",
    "stage_parts",
    "with_model_state",
    "would_have_fit",
]
