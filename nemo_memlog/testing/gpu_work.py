"""Queued GPU work: matmuls put on the current stream, returned from before they run.

Used by the GPU tests (tests/gpu/) and the GPU part of the benchmark (scripts/bench/cuda.py).
"""

from __future__ import annotations

import time

SIZE = 8192


class QueuedWork:
    """``queue(seconds)`` enqueues about that much GPU time of bf16 matmuls and returns at once."""

    def __init__(self):
        import torch

        self.a = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        self.queue_matmuls(3)  # warm-up: cuBLAS picks its kernel
        torch.cuda.synchronize()
        calls = 20
        start = time.perf_counter()
        self.queue_matmuls(calls)
        torch.cuda.synchronize()
        self.seconds_per_matmul = (time.perf_counter() - start) / calls

    def queue_matmuls(self, count: int) -> None:
        import torch

        for _ in range(count):
            torch.matmul(self.a, self.a, out=self.out)

    def queue(self, seconds: float) -> float:
        """Enqueue about ``seconds`` of work (as measured alone on this GPU); the estimate."""
        count = max(1, round(seconds / self.seconds_per_matmul))
        self.queue_matmuls(count)
        return count * self.seconds_per_matmul


def still_busy() -> bool:
    """Whether the current stream still has unfinished work."""
    import torch

    return not torch.cuda.current_stream().query()
