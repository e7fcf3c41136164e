"""The one place that talks to other ranks: gather every stage's memory report.

Steady state is ONE collective per call (a Reduction's ``exchange``: an all-gather by default,
channel.EXCHANGE), of a few int64 words per rank (see payload.py). From the gathered reports every
rank derives the same things: the per-key maximum, which rank holds it, and each rank's own values.
The same collective carries each rank's iteration and key-set fingerprint, so ranks that
disagree raise the same clear error together instead of mixing values up.

A key-set handshake (a 2-word gather) runs on the first call for a group, and again
only when some rank's key set changes. It exists because gloo, given tensors of
different lengths, returns wrong values without an error.

Every rank of a group enters the same collectives, of the same sizes, in the same order,
whatever keys each rank passes: whether to run the handshake is decided from words every
rank received alike (the agreed layout, and the fingerprints in the last gather), never
from one rank's own keys. Every wait is bounded, so a rank that does not join makes the
others raise MemoryReduceError instead of hanging.

State: a ``Reduction`` holds a channel per group (the agreed layout and its buffers) and the
gloo twins it made. A monitor (MemoryMonitor) owns one and closes it when it closes; the free
functions here share one of their own (see ``Reduction``). What belongs to the process (the
open Reductions, the free functions' one, close_writers' count) is one registry, state.PROCESS.

The modules, by job (every torch.distributed call of the package is in this package):

- ``helpers``: the public helpers (reduce_max_memory_across_pp_group, gather_memory,
  single_rank, reduction_group, twin_for, takes_part);
- ``protocol``: the key agreement and the checks of the gathered words, pure (no
  torch.distributed): optional_union, fits, the key and iteration errors;
- ``state``: Reduction (a run's channels and twins), the handshake, and PROCESS;
- ``channel``: Channel, the collectives (all_gather_single, all_to_all_single) and their
  bounded waits (the timeout and peer-left errors);
- ``twins``: the gloo groups of the same ranks (world_twin, pp_twin);
- ``restart``: close_writers' restart agreement (runs_ended, agree_on_restart);
- ``stall``: the stall watch, a thread that says when a gather has waited too long.
"""

from __future__ import annotations

from .channel import PEER_LEFT_FRACTION, Channel, all_gather_single, all_to_all_single, on_cuda
from .helpers import (
    DEFAULT_TIMEOUT_S,
    gather_memory,
    reduce_max_memory_across_pp_group,
    reduction_group,
    single_rank,
    takes_part,
    twin_for,
)
from .protocol import OPTIONAL_PREFIX, MemoryReduceError, fits, optional_union
from .restart import RUNS_ENDED_KEY, agree_on_restart, runs_ended
from .state import Reduction

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "OPTIONAL_PREFIX",
    "PEER_LEFT_FRACTION",
    "RUNS_ENDED_KEY",
    "Channel",
    "MemoryReduceError",
    "Reduction",
    "agree_on_restart",
    "all_gather_single",
    "all_to_all_single",
    "fits",
    "gather_memory",
    "on_cuda",
    "optional_union",
    "reduce_max_memory_across_pp_group",
    "reduction_group",
    "runs_ended",
    "single_rank",
    "takes_part",
    "twin_for",
]
