"""Run one module-level function in a fresh spawned process, alone in an NCCL or gloo world of one."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback

from nemo_memlog.testing.cluster import free_port


def _child(fn, args, backend, port, results):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(0)
        if backend:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        results.put(("ok", fn(*args)))
    except BaseException as error:  # the parent fails the test with this traceback
        results.put(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run_alone(fn, *args, backend: str | None = None, timeout: float = 180):
    """``fn(*args)`` in a new process on CUDA device 0 (in a world of one on ``backend``, if given)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_child, args=(fn, args, backend, free_port(), results), daemon=True)
    process.start()
    try:
        status, value = results.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"{fn.__name__} gave no result within {timeout}s") from None
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    if status != "ok":
        raise AssertionError(f"{fn.__name__} raised in its process:\n{value}")
    return value
