"""Real multi-process gloo clusters for tests, with megatron-core building the groups.

A ``Cluster`` starts ``world`` processes once, joins them in a gloo process group and
calls ``parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)``.
``cluster.run(fn, *args)`` then runs the module-level function ``fn(*args)`` on every
rank at once and returns each rank's result, in global-rank order. The ranks are forked
by multiprocessing's forkserver, which imported torch and megatron-core once (a rank
starts in a tenth of a second, not four; where CUDA is, they are spawned); a healthy
cluster is still reused across tests, and a test that breaks collectives on purpose uses
a fresh one (``with Cluster(...)``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass


@dataclass
class RankFailure:
    """What a rank raised: returned in place of a result."""

    type_name: str
    message: str
    traceback: str

    def __str__(self):
        return f"{self.type_name}: {self.message}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world, pp, port, tasks, results, env):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
        results.put((rank, "ready", None))
    except BaseException as error:  # report set-up failures instead of hanging the parent
        results.put((rank, "error", RankFailure(type(error).__name__, str(error), traceback.format_exc())))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException as error:
            results.put((rank, "error", RankFailure(type(error).__name__, str(error), traceback.format_exc())))
    _leave(results)


def _leave(results) -> None:
    """Leave at once. Left to interpreter exit, a rank sat 10-17 s in torch's native teardown
    (its gloo groups, the store) after every Python exit hook, and more after a test that broke
    a collective on purpose. So: close the runs training_log left open (their writers drain,
    their flight records end), make sure every result reached the parent, and exit with no
    further teardown. No destroy_process_group(): after a broken collective it can block."""
    import sys

    hook = sys.modules.get("nemo_memlog.monitor.training_log")
    if hook is not None:
        try:
            hook.close_writers()
        except Exception:  # a test may have left a run half-broken on purpose: leave anyway
            pass
    results.close()
    results.join_thread()
    os._exit(0)


def _context():
    """Multiprocessing's forkserver, with torch and megatron-core imported in it once
    (nemo_memlog.testing.rank_preload): a rank starts in a tenth of a second, not four. Where CUDA
    is, spawn: megatron-core's import initialises CUDA there, and a process forked after that
    cannot use it ("Cannot re-initialize CUDA in forked subprocess", seen on an H200)."""
    import torch

    if torch.cuda.is_available():  # asks the driver for the count; initialises no CUDA here
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["nemo_memlog.testing.rank_preload"])
    return ctx


class Cluster:
    def __init__(self, world: int, pp: int, env: dict | None = None, start_timeout: float = 120):
        ctx = _context()
        self.world, self.pp = world, pp
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, pp, port, self.tasks[r], self.results, env), daemon=True)
            for r in range(world)
        ]
        for proc in self.procs:
            proc.start()
        ready = self._collect(start_timeout)
        failures = [r for r in ready if isinstance(r, RankFailure)]
        if failures:
            self.close()
            raise RuntimeError(f"cluster set-up failed: {failures[0].traceback}")

    def run(self, fn, *args, timeout: float = 120, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; results (or RankFailure) by rank."""
        for task_queue in self.tasks:
            task_queue.put((fn, args, kwargs))
        return self._collect(timeout)

    def run_ok(self, fn, *args, **kwargs) -> list:
        """Like run, but any rank's failure fails the test with that rank's traceback."""
        results = self.run(fn, *args, **kwargs)
        for rank, result in enumerate(results):
            if isinstance(result, RankFailure):
                raise AssertionError(f"rank {rank} raised:\n{result.traceback}")
        return results

    def _collect(self, timeout: float) -> list:
        """Every rank's result, by rank. Raises at once, with the exit codes, once every rank still owing
        a result has died (a rank that dies puts nothing); else TimeoutError after ``timeout``, naming
        the ranks that gave none and the exit codes of those that died."""
        out: list = [None] * self.world
        pending = set(range(self.world))
        deadline = time.monotonic() + timeout
        while pending:
            try:
                rank, status, value = self.results.get(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                died = {rank: self.procs[rank].exitcode for rank in sorted(pending) if not self.procs[rank].is_alive()}
                if len(died) == len(pending):
                    raise RuntimeError(
                        f"ranks {sorted(pending)} died before giving a result (exit codes {died})"
                    ) from None
                if time.monotonic() >= deadline:
                    dead = f"; died: {died} (rank: exit code)" if died else ""
                    raise TimeoutError(f"ranks {sorted(pending)} gave no result within {timeout}s{dead}") from None
                continue
            out[rank] = value
            pending.discard(rank)
        return out

    def close(self):
        for task_queue, proc in zip(self.tasks, self.procs):
            if proc.is_alive():
                task_queue.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
