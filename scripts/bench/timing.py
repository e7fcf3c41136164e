"""The benchmarks' one timing helper: variants interleaved, tight loops, and their summaries.

Nothing here asserts a time: on a shared machine only ratios taken in one interleaved run
mean something.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def summary(samples_ns: list[int]) -> dict:
    """Median and p90 in microseconds, and the number of samples, of times in nanoseconds."""
    ordered = sorted(samples_ns)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median_us": statistics.median(ordered) / 1e3, "p90_us": p90 / 1e3, "n": len(ordered)}


def summarise(samples: dict) -> dict:
    """``summary`` of each variant's samples."""
    return {name: summary(values) for name, values in samples.items()}


def interleaved(
    variants: dict, repetitions: int, warmup: int = 20, before: Callable[[], object] | None = None
) -> tuple[dict, dict]:
    """Per-call wall and CPU times (ns) of every variant, each called with the repetition's
    number (from 1): each repetition calls every variant once, the first one rotating, so that
    drift and the machine's noise hit every variant alike. ``before`` (a barrier, say) runs
    before each call, untimed. CPU time is this process's, all its threads."""
    names = list(variants)
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for rep in range(warmup + repetitions):
        shift = rep % len(names)  # no variant always runs first, or right after the same one
        for name in names[shift:] + names[:shift]:
            if before is not None:
                before()
            cpu_start = time.process_time_ns()
            start = time.perf_counter_ns()
            variants[name](rep + 1)
            elapsed = time.perf_counter_ns() - start
            cpu_used = time.process_time_ns() - cpu_start
            if rep >= warmup:
                wall[name].append(elapsed)
                cpu[name].append(cpu_used)
    return wall, cpu


def per_call_ns(step: Callable[[int], object], calls: int, repeats: int = 3) -> float:
    """Best of ``repeats`` tight loops of ``calls`` calls, ns per call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for call in range(calls):
            step(call)
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def python_work(rounds: int) -> int:
    """Pure-Python work standing in for the training loop's next step on the same thread."""
    total = 0
    for i in range(rounds):
        total += i * i % 7
    return total


def rounds_for(seconds: float) -> int:
    """How many ``python_work`` rounds take about ``seconds`` on this machine, now."""
    rounds = 10000
    start = time.perf_counter()
    python_work(rounds)
    return max(1000, int(rounds * seconds / (time.perf_counter() - start)))


def wake_penalty(idle_s: float = 0.1, samples: int = 15) -> dict:
    """The same tiny piece of Python, hot and right after sleeping ``idle_s`` (median, us).

    On some virtual machines a thread that has slept runs its first microseconds far slower;
    every variant of the PP part runs right after a barrier (a sleep), so this inflates all of
    them, the more so the more separate wake-ups (ring steps, thread hand-offs) a variant needs."""
    hot, woken = [], []
    for _ in range(samples):
        time.sleep(idle_s)
        for times in (woken, hot):
            start = time.perf_counter_ns()
            python_work(200)
            times.append(time.perf_counter_ns() - start)
    return {"idle_s": idle_s, "hot_us": statistics.median(hot) / 1e3, "woken_us": statistics.median(woken) / 1e3}
