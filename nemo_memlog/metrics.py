"""The caller's metrics, cleaned to plain numbers, merged with the memory metrics in one dict."""

from __future__ import annotations

from collections.abc import Callable, Hashable

from .payload import scalar


def merged(metrics: dict | None, logged: dict, warn_once: Callable[[Hashable, str], None]) -> dict:
    """The caller's ``metrics`` plus the memory metrics ``logged``, in one new dict.

    A value that is no number is warned about once per key and problem, and left out where no
    scalar store could hold it; NaN stays NaN (a NaN loss is news). A key both hold keeps the
    memory value, with a warning.

    Args:
        metrics: the caller's metrics (names to numbers), or None.
        logged: the memory metrics of this step.
        warn_once: the run's once-only warning.
    """
    if not metrics:
        return logged
    unified = {}
    for key, value in metrics.items():
        clean, kind, problem = scalar(value)
        if problem is not None:
            warn_once(("metric", key, problem), f"metrics[{key!r}]: {problem}" + ("" if kind else "; it is not logged"))
        if kind is None and clean is None:
            continue  # not a number: warned above, nothing a scalar store could hold
        unified[key] = value if kind is None else clean
    for key in logged.keys() & unified.keys():
        warn_once(("clash", key), f"metrics[{key!r}] clashes with a memory metric; the memory value is logged")
    unified.update(logged)
    return unified
