"""Count the collectives a piece of code issues, while they still run for real.

This is a pass-through spy, not a mock: every wrapped call goes to torch.distributed.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "reduce",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)


@contextlib.contextmanager
def count_collectives():
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def spy(name, original):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(dist, name, spy(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


#: The name reduce/'s one collective goes by in this torch.
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
