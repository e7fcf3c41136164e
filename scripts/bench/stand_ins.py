"""What the benchmark puts in place of a GPU and of real backends, and the exchange switch.

Without CUDA every allocator statistic would be missing, so the benchmark feeds the nested
statistics an H100 gave (tests/data of a source checkout, 122 statistics) through the real
code paths; and where the hand-off itself is timed, the backends write nothing.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

#: The repository (a source checkout): tests/data and tests/trainer.py live there.
REPOSITORY = Path(__file__).resolve().parents[2]  # scripts/bench/stand_ins.py -> the repository
H100_STATISTICS = REPOSITORY / "tests" / "data" / "h100_memory_stats_nested.json"
#: The backends the benchmark writes to, by their writer modules' names.
BACKENDS = ("comet", "mlflow", "tensorboard", "wandb")


def h100_statistics() -> dict:
    """The nested allocator statistics an H100 gave, as torch's allocator returns them."""
    with open(H100_STATISTICS) as file:
        return json.load(file)


def h100_cuda_stats(stage: int) -> dict:
    """``h100_statistics()`` with byte counts scaled down 10% per stage (stage 0 holds the most)."""

    def scaled(node, in_bytes):
        if isinstance(node, dict):
            return {key: scaled(value, in_bytes or "bytes" in key) for key, value in node.items()}
        return int(node * (1 - 0.1 * stage)) if in_bytes else node

    return scaled(h100_statistics(), False)


@contextlib.contextmanager
def fed_statistics(nested: dict):
    """Without CUDA: ``nested`` is what torch's allocator returns, to our code and to torch's own
    flattening alike. Device keys stay missing (no mem_get_info without a GPU)."""
    import torch

    from nemo_memlog.rank import memory

    ours, torchs = memory.allocator_stats, torch.cuda.memory.memory_stats_as_nested_dict
    memory.allocator_stats = lambda: (None, nested)
    torch.cuda.memory.memory_stats_as_nested_dict = lambda device=None: nested
    try:
        yield
    finally:
        memory.allocator_stats, torch.cuda.memory.memory_stats_as_nested_dict = ours, torchs


@contextlib.contextmanager
def exchange(monitor, reduction):
    """``monitor`` (a MemoryMonitor) gathers through ``reduction`` inside the block: one made with
    another exchange, ``Reduction(monitor.warnings, exchange="all_to_all")``, kept across blocks so
    that its channel agrees on the keys once, as the monitor's own does."""
    previous, monitor.reduction = monitor.reduction, reduction
    try:
        yield
    finally:
        monitor.reduction = previous


class NullBackend:
    """A backend that writes nothing: where the hand-off itself is what is timed."""

    def log(self, metrics, step):
        pass

    def flush(self):
        pass

    def close(self):
        pass


def null_fanout():
    """A thread-mode fan-out of one buffered NullBackend per benchmark backend (real buffers and threads)."""
    from nemo_memlog.writers.fanout import BufferedBackend, ThreadFanOut

    return ThreadFanOut([BufferedBackend(name, NullBackend, 10000, []) for name in BACKENDS])
