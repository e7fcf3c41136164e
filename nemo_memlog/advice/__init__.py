"""What a change would do to each stage's peak: the measurement, moved by arithmetic the user can
check. Pure: no torch, no I/O, no collective. Read by ``nemo-memlog advise`` (offline/advise/__init__.py),
the low-headroom warning and the dashboard's ``memory/advice/max_micro_batch_size`` (monitor/__init__.py),
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

Known limitations:

- A micro-batch change scales activations linearly with the micro-batch size, and the
  temporaries in proportion too (or by F**p, p from two runs at two sizes: ``growth_between``).
- Allocator slack (fragmentation) is held as measured, except under ``expandable_segments``,
  which sets it to 0 (what the allocator's rounding keeps is not predicted).
- Microbatches in flight follow Megatron's 1F1B and interleaved warm-up rules; other schedules
  (zero-bubble, combined 1F1B) are refused when stated, and a measured count the rule does not
  give is refused.
- Full recompute keeps each layer's measured input only; its working set during the backward is
  not predicted (temporaries held as measured). Selective recompute needs Bridge 0.6+'s ratio.
- Layer moves carry whole layers with their measured parts, one model chunk per stage only.
- A storage every microbatch shares (a cached rotary table) is scaled with the microbatches in flight.
- Memory outside the model's forward that grows with the batch (a loss on the logits) is not
  modelled apart: it scales where it lies in the temporaries (GPU; CPU with a measured idle
  size), else it is held constant.
- What the measurement does not see (measure/activations.py, measure/composition.py) is not
  predicted either. Tensor or context parallel changes, CPU offload and MoE imbalance: not offered.
"""

from .live import (
    MAX_MICRO_BATCH,
    fix_sentence,
    headroom_warnings,
    oom_run,
    run_from_gathered,
    stage_parts,
    step_metrics,
    would_have_fit,
)
from .model import (
    CHANGES,
    MODEL_STATE,
    PARTS,
    Change,
    Node,
    Outcome,
    Profile,
    Refused,
    Stage,
    fmt,
    growth_between,
    job_difference,
    parse,
    peak,
    with_model_state,
)
from .predict import MAX_DIVISORS, MAX_RANGE, divisors, max_micro_batch_size, predict, schedule_name, smallest_fix
from .search import COSTS, Fix, balanced_split, changes_that_fit

__all__ = [
    "CHANGES",
    "COSTS",
    "MAX_DIVISORS",
    "MAX_RANGE",
    "divisors",
    "Fix",
    "balanced_split",
    "changes_that_fit",
    "Change",
    "MODEL_STATE",
    "Node",
    "Outcome",
    "PARTS",
    "MAX_MICRO_BATCH",
    "Refused",
    "Profile",
    "Stage",
    "fix_sentence",
    "fmt",
    "growth_between",
    "job_difference",
    "max_micro_batch_size",
    "oom_run",
    "parse",
    "peak",
    "predict",
    "schedule_name",
    "run_from_gathered",
    "headroom_warnings",
    "step_metrics",
    "smallest_fix",
    "stage_parts",
    "with_model_state",
    "would_have_fit",
]
