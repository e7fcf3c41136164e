"""The key-agreement protocol and the checks of the gathered words: pure functions of what every
rank received alike, so every rank decides the same and raises the same error.

No torch.distributed here (tests/test_shape.py checks it): the collectives that carry these words
are channel.py's, the handshake that runs them state.py's. A group appears here only as the
words that name it in an error (``describe(group)``, called on the error path only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .. import payload
from ..config.validation import REDUCE_EXCHANGES


class MemoryReduceError(RuntimeError):
    """A memory reduction failed: the ranks disagree (keys, iteration), or one did not join in time.

    A RuntimeError; its message names the group and says what to change.
    """


#: Keys a rank may report while others do not: a memory phase (measure/phase.py) only some stages ran.
#: Ranks that differ only in these agree on the union, and a rank sends those it lacks as missing.
OPTIONAL_PREFIX = "phase/"


def optional_union(key_lists: list) -> tuple[str, ...] | None:
    """The agreed keys of ranks that differ in optional keys only: the common keys in their order,
    then every optional key, sorted (the same on every rank). None when other keys differ."""
    required = [[k for k in keys if not k.startswith(OPTIONAL_PREFIX)] for keys in key_lists]
    if any(keys != required[0] for keys in required):
        return None
    optional = sorted({k for keys in key_lists for k in keys if k.startswith(OPTIONAL_PREFIX)})
    return (*required[0], *optional)


@functools.lru_cache(maxsize=64)
def fits(mine: tuple[str, ...], agreed: tuple[str, ...]) -> bool:
    """Whether a rank reporting ``mine`` can send in the ``agreed`` layout: the same required keys in
    the same order, and its optional keys among the agreed ones."""
    required = tuple(k for k in mine if not k.startswith(OPTIONAL_PREFIX))
    return required == tuple(k for k in agreed if not k.startswith(OPTIONAL_PREFIX)) and set(mine) <= set(agreed)


def key_mismatch_message(key_lists: list, where: str) -> str:
    """The error every rank raises when the ranks' keys differ beyond optional ones; ``where``
    names the group ("the group of global ranks [...]")."""
    union: list = []
    for keys in key_lists:
        union.extend(k for k in keys if k not in union)
    lines = []
    for rank, keys in enumerate(key_lists):
        lacking = [k for k in union if k not in keys]
        order = "" if lacking or keys == key_lists[0] else " (same keys, different order)"
        lines.append(f"  rank {rank}: {len(keys)} keys" + (f", lacks {lacking}" if lacking else "") + order)
    return (
        f"memory reduction over {where}: ranks report different keys, so values cannot be "
        f"lined up.\n" + "\n".join(lines) + "\nGive every rank the same memory_keys (and the same "
        "report keys in the same order); use NaN for a statistic one rank lacks."
    )


#: memory_reduce_exchange's values; the handshake sends each rank's as its index here.
EXCHANGES = REDUCE_EXCHANGES


def exchange_mismatch_message(exchanges: list[str], where: str) -> str:
    """The error every rank raises when the ranks' steady-state exchanges differ (``exchanges[r]``:
    position r's), before either collective runs: they would not match."""
    by_exchange = {name: [r for r, e in enumerate(exchanges) if e == name] for name in EXCHANGES if name in exchanges}
    said = "; ".join(f"{name!r} at position(s) {ranks}" for name, ranks in by_exchange.items())
    return (
        f"memory reduction over {where}: the ranks' memory_reduce_exchange differ ({said}); each would "
        f"enter a different collective. Set logger.memory_reduce_exchange alike on every rank."
    )


def check_iterations(
    reports: list, iteration: int | None, interval: int | None, group: Any, describe: Callable[[Any], str]
) -> None:
    """Raise MemoryReduceError when the ranks sent different iterations (every rank sees the same
    words, so every rank raises). ``interval``: this rank's tensorboard_log_interval. A rank logs only
    at multiples of its own interval, so another rank's iteration that is no multiple of this rank's
    says their intervals differ; the error then says that, not that a call was skipped. (The header
    carries the iteration only, so a rank whose own interval divides every iteration seen cannot
    tell the two apart: its error names both causes.) ``describe(group)`` names the group in the
    error, and is called only then."""
    if iteration is None:
        return
    seen = [report.iteration for report in reports]
    if len(set(seen)) == 1:
        return
    listing = ", ".join(f"rank {rank}: {it}" for rank, it in enumerate(seen))
    at = f"memory reduction over {describe(group)}: ranks are at different iterations ({listing})."
    if not interval:
        raise MemoryReduceError(
            f"{at} Every rank must call training_log with the same iteration; one stage skipped or repeated a call."
        )
    off = [
        f"rank {rank}'s iteration {it}" for rank, it in enumerate(seen) if it != payload.NOT_CHECKED and it % interval
    ]
    if off:
        raise MemoryReduceError(
            f"{at} The ranks log at different tensorboard_log_interval: this rank logs every {interval} iterations, "
            f"and {', '.join(off)}: no multiple of {interval}. Every rank must use the same tensorboard_log_interval "
            f"(the same logger config), so that every rank logs at the same iterations."
        )
    raise MemoryReduceError(
        f"{at} Either a stage skipped or repeated a call (every rank must call training_log at every iteration), "
        f"or a rank's tensorboard_log_interval differs from this rank's ({interval}): every rank must use the "
        f"same tensorboard_log_interval (the same logger config)."
    )
