"""The run's facts (``training_log(..., facts=...)``, ``MemoryMonitor.state_facts``): their rules,
checked once, where they are given, with one message shape naming the fact and what to write.

Known facts have types (``KNOWN``); any other fact is a JSON-safe scalar (a bool, a number, a
short string). A fact named like a secret (``secret_name``), or whose value is one of the run's
secrets, is recorded as ``REDACTED``. The whole is bounded (``MAX_FACTS`` facts, each at most
``MAX_FACT_BYTES`` serialized): the facts go into every per-layer record and the live advice.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..redaction import REDACTED, secret_name

#: The largest count (micro-batch size, microbatches per iteration...) a fact may state.
MAX_COUNT = 2**20
#: The largest global batch size (micro-batch size x microbatches x data parallelism).
MAX_GLOBAL_BATCH = 2**40
MAX_FACTS = 64
MAX_FACT_BYTES = 4096
MAX_NAME = 100
RECOMPUTE = ("none", "full", "selective")


def _count(limit: int) -> tuple[Callable[[Any], Any], str]:
    def check(value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return None
        value = int(value)
        return value if 1 <= value <= limit else None

    return check, f"a positive int, at most {limit}"


def _flag(value):
    return value if isinstance(value, bool) else None


def _text(value):
    return value if isinstance(value, str) and 0 < len(value) <= 200 else None


def _recompute(value):
    return value if value in RECOMPUTE else None


def _ratio(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) and 0 <= value <= 1 else None


#: Known facts: name -> (the checked value, or None where it breaks the rule; what to write).
KNOWN: dict[str, tuple[Callable[[Any], Any], str]] = {
    "micro_batch_size": _count(MAX_COUNT),
    "microbatches": _count(MAX_COUNT),
    "microbatch_group_size_per_vp_stage": _count(MAX_COUNT),
    "global_batch_size": _count(MAX_GLOBAL_BATCH),
    "distributed_optimizer": (_flag, "true or false (a bool)"),
    "optimizer_sharded": (_flag, "true or false (a bool)"),
    "recompute": (_recompute, f"one of {', '.join(map(repr, RECOMPUTE))}"),
    "schedule": (_text, "the pipeline schedule's name, a string (e.g. '1f1b', 'interleaved')"),
    "optimizer": (_text, "the optimizer's name, a string"),
    "framework": (_text, "a string"),
    "selective_recompute_ratio": (_ratio, "a number in [0, 1]"),
}


def _scalar(value):
    """Any other fact: a bool, an int, a finite float or a string, as JSON writes it."""
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return None


def _refused(name: str, takes: str, value: Any) -> ValueError:
    """The one message for a fact that cannot be recorded: the fact, what to write, what was given."""
    return ValueError(f"facts[{name!r}] must be {takes}; got {_short(value)} ({type(value).__name__})")


def _short(value: Any) -> str:
    try:
        shown = repr(value)
    except Exception:  # noqa: BLE001 -- a value whose repr raises is shown by its type alone
        return "a value"
    return shown if len(shown) <= 80 else f"{shown[:60]}... ({len(shown)} characters)"


def checked_facts(facts: Any, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """``facts`` checked and copied: the known facts of their types, the others JSON-safe scalars,
    secrets redacted, None values left out. Raises TypeError (not a mapping, a name that is not a
    string) or ValueError (a value that breaks its rule, too many facts, a fact too large), naming
    the fact and what to write. ``secrets``: the run's secret values (a fact holding one is redacted)."""
    if not isinstance(facts, Mapping):
        raise TypeError(
            f"facts= must be a dict of the run's facts (e.g. {{'micro_batch_size': 4, 'microbatches': 8}}); "
            f"got {type(facts).__name__}"
        )
    if len(facts) > MAX_FACTS:
        raise ValueError(f"facts= holds {len(facts)} facts; at most {MAX_FACTS}: pass only what the run states")
    secret_values = {secret for secret in secrets if secret}
    out: dict[str, Any] = {}
    for name, value in facts.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise TypeError(f"facts= names must be strings of 1 to {MAX_NAME} characters; got {_short(name)}")
        if value is None:
            continue
        if secret_name(name) or (isinstance(value, str) and any(s in value for s in secret_values)):
            out[name] = REDACTED  # never written: the record keeps only that the fact was stated
            continue
        check, takes = KNOWN.get(name, (_scalar, "a bool, a number or a string (JSON's scalars)"))
        checked = check(value)
        if checked is None:
            raise _refused(name, takes, value)
        if isinstance(checked, str) and len(json.dumps(checked)) > MAX_FACT_BYTES:
            raise ValueError(
                f"facts[{name!r}] must be at most {MAX_FACT_BYTES} bytes as JSON; got a string of "
                f"{len(checked)} characters: state a name, not a document"
            )
        out[name] = checked
    return out
