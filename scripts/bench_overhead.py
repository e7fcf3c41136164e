"""What nemo_memlog costs per logged step, against the reductions the field uses. ``make bench``.

    python scripts/bench_overhead.py             # PP 2, 4, 8 on gloo, then the non-logging and writer parts
    python scripts/bench_overhead.py --smoke     # PP 2, few iterations, TensorBoard only (tests/test_bench_smoke.py)
    python scripts/bench_overhead.py --pp 2 4 --iters 300 --json out.json

Part 1, per PP size: the script forks that many processes, joins them in a gloo group and
lets megatron-core's parallel_state build the PP group (world == PP group). Every rank runs
the same sequence: per repetition each variant once, each after a barrier, the first
variant rotating, so that drift and the shared machine's noise hit every variant alike.

    ours      (a) training_log(iteration, cfg) on a logging iteration: report_memory() +
              capacity_report() (/proc reads), the flight record (on, as by default),
              gather_memory (pack, ONE collective, unpack, line up), attribution, and on
              the writer rank the hand-off to a thread-mode
              FanOut of four Sinks (real buffers and threads; backends that write nothing: the
              real backends, and the writer process, are part 3)
    reduce    gather_memory(report, group) alone: the reduction part of ``ours``
    bridge    (b) Megatron-Bridge's reduce_max_memory_across_pp_group: float64 all_reduce MAX
    composer  (c) Composer's MemoryMonitor: an all_reduce per metric for each of avg, min, max
    floor     (d) one all_reduce of a 1-element tensor
    ours_a2a, reduce_a2a   the same as ours and reduce with reduce.EXCHANGE = "all_to_all"

``reduce``, ``bridge`` and ``composer`` start from the same ready report; only ``ours`` reads
memory. Without CUDA every allocator statistic would be missing, so ``report_memory`` reads
the nested statistics an H100 gave (tests/data, 122 statistics; byte counts 10% lower per
stage) through its real path-by-path code; host memory is real.
Every worker runs with torch.set_num_threads(1) and OMP_NUM_THREADS=1. Besides wall time,
each call's CPU time (the whole process, gloo's threads included) is recorded. A second,
shorter interleaved loop times the pieces of ``ours`` one by one, each after a barrier as in
a real logging step ("cold"); the writer rank then times them in tight loops ("hot").

Part 2 (on the first PP size's writer rank): training_log off the logging iterations, time
per call and collectives issued (a pass-through spy on torch.distributed).
Part 3 (this process): the writer rank with real backends (all four, in a temp dir:
TensorBoard, an MLflow SQLite store, W&B with WANDB_MODE=offline, a Comet offline archive),
in each writer_mode: ``thread`` (the backends in threads of this process) and ``process``
(in a writer process). Per step, in a random order, each after a 30 ms sleep: each mode's
``log`` and then a fixed piece of pure-Python work on this thread (``--work-ms``), logging
off (the work alone), and the backends called synchronously (for scale). It reports the
hand-off (how long ``log`` holds the training thread) and the loss: hand-off plus work,
minus the adjacent logging-off work, so GIL and CPU contention are included.
Part 5 (bench_cuda.py): reading the allocator statistics (without CUDA: the H100's, fed
through our code and through torch.cuda.memory_stats()'s own flattening); where CUDA is present
(not with --smoke or --no-gpu), the GPU part: a logging step against Megatron-Bridge's, the
floor, and a logging step behind queued GPU work.
Part 6 (this process; the recorder adds no collective, so one process shows its cost): the
flight recorder on and off (``memory_record_dir`` a temp dir, or "off"), with the GPU-like
report. Off the logging steps: training_log at off-interval iterations, each variant a tight
loop of calls per round, rounds interleaved. On a logging step: MemoryMonitor.log_step
without a group (report, record, attribution, hand-off to a writer that does nothing), each
call timed alone, variants in a rotating order; and ``record`` alone. Also the liveness
thread's beat (the /proc reads and one pwrite), which runs about once a second.
Part 4 (not with --smoke or --no-memory): tests/trainer.py three times, logging off and in
each mode, with the same backends: the writer rank's host RSS after 20 logged steps.

The tables show for each variant the largest median (and p90) over the ranks, and ratios of
those medians. Nothing here asserts a timing: on a shared machine only ratios taken in one
interleaved run mean something.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nemo_memlog.testing.collectives import count_collectives  # noqa: E402  the same pass-through spy the tests use

VARIANTS = ("ours", "reduce", "bridge", "composer", "floor", "ours_a2a", "reduce_a2a")
PIECES = ("report_memory", "capacity_report", "pack", "all_gather", "all_to_all", "unpack", "line_up",
          "attribution", "hand_off")
DEFAULT_ITERS = {2: 400, 4: 300, 8: 200}
BACKENDS = ("comet", "mlflow", "tensorboard", "wandb")
NON_LOGGING_INTERVAL = 100
GB = 1e9


# --------------------------------------------------------------------------------------------
# The anchors, as their projects write them (the device aside: gloo needs CPU tensors).


def bridge_reduce_max(memory_report: dict, pp_group, device: str = "cpu") -> dict:
    """Megatron-Bridge PR 3645's reduce_max_memory_across_pp_group (device="cpu" for gloo)."""
    if not memory_report:
        return memory_report
    if not dist.is_available() or not dist.is_initialized():
        return memory_report
    pp_size_attr = getattr(pp_group, "size", None)
    if not callable(pp_size_attr) or pp_size_attr() <= 1:
        return memory_report
    return bridge_all_reduce_max(memory_report, pp_group, device)


def bridge_all_reduce_max(memory_report: dict, pp_group, device: str) -> dict:
    """The collective part of bridge_reduce_max (bench_cuda.py runs it at world size 1 too)."""
    keys = list(memory_report.keys())
    values = torch.tensor([memory_report[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=pp_group)
    reduced = {}
    for key, max_val in zip(keys, values.tolist()):
        original = memory_report[key]
        if not isinstance(original, bool) and isinstance(original, int):
            reduced[key] = int(max_val)
        else:
            reduced[key] = max_val
    return reduced


def composer_reduce_value(value, group, reduce_op: str = "mean"):
    """Composer's MemoryMonitor reduce_value: a new tensor and one all_reduce per call."""
    tensor_value = torch.tensor(value, device="cpu")
    if reduce_op in ["mean", "avg", "sum"]:
        op = dist.ReduceOp.SUM
    elif reduce_op == "min":
        op = dist.ReduceOp.MIN
    elif reduce_op == "max":
        op = dist.ReduceOp.MAX
    else:
        raise ValueError(f"{reduce_op=} not supported.")
    dist.all_reduce(tensor_value, op=op, group=group)
    if reduce_op in ["mean", "avg"]:
        tensor_value = tensor_value / dist.get_world_size(group)
    return tensor_value.item()


def composer_reduce(memory_report: dict, group) -> dict:
    """Composer's dist_aggregate_batch_interval block: avg, min and max of every metric."""
    dist_memory_report = {}
    for mem_stat, val in memory_report.items():
        dist_memory_report[mem_stat + "_avg"] = composer_reduce_value(val, group, "avg")
        dist_memory_report[mem_stat + "_min"] = composer_reduce_value(val, group, "min")
        dist_memory_report[mem_stat + "_max"] = composer_reduce_value(val, group, "max")
    return dist_memory_report


# --------------------------------------------------------------------------------------------
# Helpers.


@contextlib.contextmanager
def exchange(mode: str):
    from nemo_memlog import reduce

    previous, reduce.EXCHANGE = reduce.EXCHANGE, mode
    try:
        yield
    finally:
        reduce.EXCHANGE = previous


def h100_cuda_stats(stage: int) -> dict:
    """The nested allocator statistics an H100 gave (tests/data), byte counts scaled down 10%
    per stage (stage 0 holds the most): what torch's allocator returns, 122 statistics."""
    with open(os.path.join(ROOT, "tests", "data", "h100_memory_stats_nested.json")) as file:
        stats = json.load(file)

    def scaled(node, in_bytes):
        if isinstance(node, dict):
            return {key: scaled(value, in_bytes or "bytes" in key) for key, value in node.items()}
        return int(node * (1 - 0.1 * stage)) if in_bytes else node

    return scaled(stats, False)


def summary(samples_ns: list[int]) -> dict:
    ordered = sorted(samples_ns)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median_us": statistics.median(ordered) / 1e3, "p90_us": p90 / 1e3, "n": len(ordered)}


def interleaved(variants: dict, repetitions: int, warmup: int, group) -> tuple[dict, dict]:
    """Per-call wall and CPU times (ns): each repetition runs every variant once, each after
    a barrier. CPU time is this process's, all threads (gloo's included)."""
    names = list(variants)
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for rep in range(warmup + repetitions):
        shift = rep % len(names)  # no variant always runs first after the previous one
        for name in names[shift:] + names[:shift]:
            dist.barrier(group=group)
            cpu_start = time.process_time_ns()
            start = time.perf_counter_ns()
            variants[name](rep + 1)
            elapsed = time.perf_counter_ns() - start
            cpu_used = time.process_time_ns() - cpu_start
            if rep >= warmup:
                wall[name].append(elapsed)
                cpu[name].append(cpu_used)
    return wall, cpu


class NullBackend:
    """A backend that writes nothing: in part 1 the hand-off itself is what is timed."""

    def log(self, metrics, step):
        pass

    def flush(self):
        pass

    def close(self):
        pass


def null_fanout():
    from nemo_memlog.writers.fanout import FanOut, Sink

    return FanOut([Sink(name, NullBackend, 10000, []) for name in BACKENDS])


# --------------------------------------------------------------------------------------------
# Part 1 (and 2): one PP group.


def worker(rank: int, world: int, port: int, plan: dict, results) -> None:
    try:
        results.put((rank, run_rank(rank, world, port, plan)))
    except BaseException as error:  # report it instead of leaving the parent waiting
        import traceback

        results.put((rank, {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}))


def run_rank(rank: int, world: int, port: int, plan: dict) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    from nemo_memlog import memory
    from nemo_memlog.config import LoggerConfig
    from nemo_memlog.hook import training_log
    from nemo_memlog.reduce import gather_memory

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    group = parallel_state.get_pipeline_model_parallel_group()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    stats = h100_cuda_stats(stage)
    memory._allocator_stats = lambda: (None, stats)  # an H100's statistics, through the real code, on a CPU machine

    # The flight recorder is on, as by default (its folder a temp dir rather than ./memory_records).
    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=1, memory_record_dir=plan["records"])
    timeout_s = cfg.memory_reduce_timeout_s
    fanout = null_fanout()
    report = memory.report_memory()
    report.update(memory.capacity_report())
    one = torch.zeros(1)
    last = {}

    def ours(iteration):
        last["unified"] = training_log(iteration, cfg, pp_group=group, writers=fanout)

    def ours_a2a(iteration):
        with exchange("all_to_all"):
            ours(iteration)

    def reduce_a2a(iteration):
        with exchange("all_to_all"):
            gather_memory(report, group, iteration=iteration, timeout_s=timeout_s)

    variants = {
        "ours": ours,
        "reduce": lambda it: gather_memory(report, group, iteration=it, timeout_s=timeout_s),
        "bridge": lambda it: bridge_reduce_max(report, group),
        "composer": lambda it: composer_reduce(report, group),
        "floor": lambda it: dist.all_reduce(one, group=group),
        "ours_a2a": ours_a2a,
        "reduce_a2a": reduce_a2a,
    }
    out = {"rank": rank, "stage": stage}
    out["samples"], out["cpu"] = interleaved(variants, plan["iters"], plan["warmup"], group)
    iteration = plan["warmup"] + plan["iters"] + 1
    with count_collectives() as calls:
        ours(iteration)
    out["collectives_per_logging_call"] = calls
    with count_collectives() as calls, exchange("all_to_all"):
        ours(iteration + 1)
    out["collectives_per_logging_call_a2a"] = calls
    with exchange("all_to_all"):
        by_a2a = gather_memory(report, group, iteration=iteration + 2)
    out["a2a_identical"] = repr(by_a2a) == repr(gather_memory(report, group, iteration=iteration + 2))
    out["unified"] = last["unified"]
    steps = pieces(group, report, last["unified"])
    out["pieces"] = summarise(interleaved(steps, plan["piece_iters"], 3, group)[0])
    dist.barrier(group=group)
    if rank == world - 1:  # hot: each piece in a tight loop, the other ranks blocked meanwhile
        out["pieces_hot_us"] = {name: per_call_ns(step, plan["hot_calls"]) / 1e3
                                for name, step in steps.items() if name not in ("all_gather", "all_to_all")}
    dist.barrier(group=group)
    if plan["non_logging"]:
        dist.barrier(group=group)
        if rank == world - 1:
            out["non_logging"] = non_logging(group, plan["non_logging"])
        dist.barrier(group=group)  # the other ranks wait, blocked in gloo, meanwhile
    fanout.close(5)
    return out


def per_call_ns(step, calls: int, repeats: int = 3) -> float:
    """Best of ``repeats`` tight loops of ``calls`` calls, ns per call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for call in range(calls):
            step(call)
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def summarise(samples: dict) -> dict:
    return {name: summary(values) for name, values in samples.items()}


def pieces(group, report, unified) -> dict:
    """The steps of ``ours`` one by one, on the buffers and data of the last logging call."""
    from nemo_memlog import attribution, memory, payload, reduce

    channel = reduce._channels[group]
    layout = channel.layout
    reports = payload.unpack(layout, channel.recv_words, channel.ranks)
    gathered = reduce._line_up(layout.keys, reports)
    channel.send_rows[1:] = channel.send_words  # every row is this rank's words, as all_to_all sends them
    fanout = null_fanout()
    return {
        "report_memory": lambda it: memory.report_memory(),
        "capacity_report": lambda it: memory.capacity_report(),
        "pack": lambda it: payload.pack_into(channel.send_words, layout, report, it, reduce._warn_once),
        "all_gather": lambda it: reduce._all_gather_single(channel.recv, channel.send_row, group).wait(),
        "all_to_all": lambda it: reduce._all_to_all_single(channel.recv, channel.send, group).wait(),
        "unpack": lambda it: payload.unpack(layout, channel.recv_words, channel.ranks),
        "line_up": lambda it: reduce._line_up(layout.keys, reports),
        "attribution": lambda it: attribution.memory_metrics(gathered, ("peak_*",)),
        "hand_off": lambda it: fanout.log(unified, it),
    }


def non_logging(group, calls: int) -> dict:
    """training_log off the logging iterations: time per call and collectives issued."""
    from nemo_memlog.config import LoggerConfig
    from nemo_memlog.hook import training_log

    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=NON_LOGGING_INTERVAL)
    iterations = [i for i in range(1, 2 * calls) if i % NON_LOGGING_INTERVAL][:calls]
    with count_collectives() as issued:
        returned = [training_log(iteration, cfg, pp_group=group) for iteration in iterations]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for iteration in iterations:
            training_log(iteration, cfg, pp_group=group)
        best = min(best, (time.perf_counter_ns() - start) / len(iterations))
    start = time.perf_counter_ns()
    for iteration in iterations:
        pass
    loop_ns = (time.perf_counter_ns() - start) / len(iterations)
    return {"calls": len(iterations), "ns_per_call": best, "loop_ns": loop_ns, "collectives": len(issued),
            "all_none": all(r is None for r in returned)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cluster(world: int, plan: dict, timeout_s: float) -> list[dict]:
    # fork: the children inherit the parent's imported torch and megatron-core, where spawn
    # would import them again in every process (about 10 s of CPU each).
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, plan, results), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    out: list = [None] * world
    try:
        for _ in range(world):
            rank, value = results.get(timeout=timeout_s)
            if "error" in value:
                raise RuntimeError(f"PP {world}, rank {rank} failed:\n{value['error']}")
            out[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return out


def cluster_row(world: int, ranks: list[dict]) -> dict:
    """Per variant: the largest median and p90 over the ranks (and the writer rank's own)."""
    row = {"pp": world, "variants": {}, "writer": {}, "per_rank_median_us": {}, "cpu_us": {}}
    for name in VARIANTS:
        per_rank = [summary(r["samples"][name]) for r in ranks]
        row["variants"][name] = {"median_us": max(s["median_us"] for s in per_rank),
                                 "p90_us": max(s["p90_us"] for s in per_rank), "n": per_rank[0]["n"]}
        row["writer"][name] = per_rank[-1]
        row["per_rank_median_us"][name] = [s["median_us"] for s in per_rank]
        row["cpu_us"][name] = max(summary(r["cpu"][name])["median_us"] for r in ranks)
    writer = ranks[-1]
    for key in ("collectives_per_logging_call", "collectives_per_logging_call_a2a", "pieces", "pieces_hot_us"):
        row[key] = writer[key]
    row["keys_logged"] = len(writer["unified"])
    row["a2a_identical"] = all(r["a2a_identical"] for r in ranks)
    return row


# --------------------------------------------------------------------------------------------
# Part 3: the writer rank with real backends, against calling them synchronously.


def python_work(rounds: int) -> int:
    """Pure-Python work standing in for the training loop's next step on the same thread."""
    total = 0
    for i in range(rounds):
        total += i * i % 7
    return total


MODES = ("thread", "process")
WRITER_SETTLE_S = 0.03  # lets a backend's own background work (W&B's service, Comet's streamer) finish


def writer_part(metrics: dict, steps: int, backends: tuple, root: str, work_ms: float) -> dict:
    """The writer rank with real backends, in each ``writer_mode``, against logging off.

    Every step runs four variants, in a random order, each starting after a 30 ms sleep with
    every backend idle: for each mode, ``log`` then a fixed piece of
    pure-Python work on this (the training) thread, then a flush outside the timing; logging
    off: the same work alone; and, for scale, the backends called synchronously. The loss of
    a mode is its hand-off plus its work, minus the adjacent logging-off work: what the
    training thread lost to logging that step, GIL and CPU contention included."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    import importlib

    from nemo_memlog.config import LoggerConfig, flat_params
    from nemo_memlog.writers import build_writers

    def config(name, mode="thread"):
        chosen = {
            "tensorboard": dict(tensorboard_dir=f"{root}/{name}/tensorboard"),
            "wandb": dict(wandb_project="bench", wandb_exp_name=name, wandb_save_dir=f"{root}/{name}"),
            "mlflow": dict(mlflow_experiment="bench", mlflow_run_name=name,
                           mlflow_tracking_uri=f"sqlite:///{root}/{name}/mlflow.db"),
            "comet": dict(comet_project="bench", comet_offline_directory=f"{root}/{name}/comet"),
        }
        fields = {k: v for backend in backends for k, v in chosen[backend].items()}
        return LoggerConfig(log_memory_to_tensorboard=True, writer_mode=mode, **fields)

    for name in ("sync",) + MODES:
        os.makedirs(f"{root}/{name}", exist_ok=True)
    opened = time.perf_counter()
    fanouts = {mode: build_writers(config(mode, mode)) for mode in MODES}
    for fanout in fanouts.values():
        fanout.log(metrics, 0)  # opens the backends, in their threads (of the writer process)
    sync_cfg = config("sync")
    params = flat_params(sync_cfg)
    synchronous_backends = [importlib.import_module(f"nemo_memlog.writers.{backend}").open_backend(sync_cfg, params, [])
                            for backend in backends]
    for mode, fanout in fanouts.items():
        if not fanout.flush(180):
            raise RuntimeError(f"the {mode} fan-out's backends did not open: {fanout.stats()}")
    for backend in synchronous_backends:
        backend.log(metrics, 0)
    open_s = time.perf_counter() - opened
    rounds = _rounds_for(work_ms / 1e3)
    handoff = {mode: [] for mode in MODES}
    handoff_cpu = {mode: [] for mode in MODES}
    busy = {mode: [] for mode in MODES + ("off",)}
    others = {mode: [] for mode in MODES}
    synchronous = []

    def logging_step(mode, step):
        process_cpu, thread_cpu = time.process_time_ns(), time.thread_time_ns()
        start = time.perf_counter_ns()
        fanouts[mode].log(metrics, step)
        handed = time.perf_counter_ns()
        handoff_cpu[mode].append(time.thread_time_ns() - thread_cpu)
        python_work(rounds)  # the training thread goes on while the backends write
        handoff[mode].append(handed - start)
        busy[mode].append(time.perf_counter_ns() - start)
        fanouts[mode].flush(60)  # the next variant starts with every backend idle
        # CPU this process spent on the step outside the training thread: what competes for its GIL
        others[mode].append(time.process_time_ns() - process_cpu - (time.thread_time_ns() - thread_cpu))

    def off_step(step):
        start = time.perf_counter_ns()
        python_work(rounds)
        busy["off"].append(time.perf_counter_ns() - start)

    def synchronous_step(step):
        start = time.perf_counter_ns()
        for backend in synchronous_backends:
            backend.log(metrics, step)
        synchronous.append(time.perf_counter_ns() - start)

    variants = [lambda step, mode=mode: logging_step(mode, step) for mode in MODES] + [off_step, synchronous_step]
    order = random.Random(0)
    for step in range(1, steps + 1):
        order.shuffle(variants)  # no variant always follows the same one (and its backends' tail)
        for variant in variants:
            time.sleep(WRITER_SETTLE_S)  # every variant starts alike: after a sleep, the backends idle
            variant(step)
    stats = {mode: fanout.stats() for mode, fanout in fanouts.items()}
    closed = time.perf_counter()
    for fanout in fanouts.values():
        fanout.close(60)
    for backend in synchronous_backends:
        backend.close()
    return {
        "steps": steps, "keys": len(metrics), "backends": list(backends), "work_ms": work_ms,
        "handoff": {mode: summary(handoff[mode]) for mode in MODES},
        "handoff_cpu": {mode: summary(handoff_cpu[mode]) for mode in MODES},
        "loss": {mode: summary([b - o for b, o in zip(busy[mode], busy["off"])]) for mode in MODES},
        "other_threads_cpu": {mode: summary(others[mode]) for mode in MODES},
        "work_off": summary(busy["off"]), "synchronous": summary(synchronous),
        "dropped": {mode: sum(s["dropped"] for s in stats[mode].values()) for mode in MODES},
        "failures": {mode: {name: s["failures"] for name, s in stats[mode].items() if s["failures"]} for mode in MODES},
        "open_s": open_s, "close_s": time.perf_counter() - closed,
    }


def host_memory_part(backends: tuple, root: str) -> dict:
    """The writer rank's host RSS after 20 logged steps (tests/trainer.py), per mode and off, MB."""
    import subprocess

    trainer = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "trainer.py")
    memory = {}
    for mode in ("off",) + MODES:
        done = subprocess.run([sys.executable, trainer, f"{root}/rss_{mode}", "--mode", mode,
                               "--backends", ",".join(backends)], capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"tests/trainer.py --mode {mode} failed:\n{done.stderr[-2000:]}")
        memory[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    return memory


def wake_penalty(idle_s: float = 0.1, samples: int = 15) -> dict:
    """The same tiny piece of Python, hot and right after sleeping ``idle_s`` (median, us).

    On some virtual machines a thread that has slept runs its first microseconds far slower;
    every variant here runs right after a barrier (a sleep), so this inflates all of them,
    the more so the more separate wake-ups (ring steps, thread hand-offs) a variant needs."""
    hot, woken = [], []
    for _ in range(samples):
        time.sleep(idle_s)
        for times in (woken, hot):
            start = time.perf_counter_ns()
            python_work(200)
            times.append(time.perf_counter_ns() - start)
    return {"idle_s": idle_s, "hot_us": statistics.median(hot) / 1e3, "woken_us": statistics.median(woken) / 1e3}


def _rounds_for(seconds: float) -> int:
    rounds = 10000
    start = time.perf_counter()
    python_work(rounds)
    return max(1000, int(rounds * seconds / (time.perf_counter() - start)))


# --------------------------------------------------------------------------------------------
# Part 5: the flight recorder.


def recorder_part(repetitions: int, off_calls: int, rounds: int) -> dict:
    """The recorder's cost off and on the logging steps, in this process (no group: it adds no
    collective). Variants interleaved; medians in us, and the on/off ratios."""
    from nemo_memlog import memory
    from nemo_memlog.config import LoggerConfig
    from nemo_memlog.hook import training_log
    from nemo_memlog.monitor import MemoryMonitor
    from nemo_memlog.failure.recorder import HostEvidence

    saved = memory._allocator_stats
    stats = h100_cuda_stats(0)
    memory._allocator_stats = lambda: (None, stats)  # a GPU-like report: the record's real size
    root = tempfile.mkdtemp(prefix="nemo_memlog_bench_records_")
    try:
        settings = {"off": "off", "on": root}
        monitors = {name: MemoryMonitor(LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir=folder),
                                        writers=NullBackend()) for name, folder in settings.items()}
        for monitor in monitors.values():
            monitor.place()
        recorder = monitors["on"].recorder
        report = monitors["on"]._report()
        logging = {"log_step_off": monitors["off"].log_step, "log_step_on": monitors["on"].log_step,
                   "record_alone": lambda it: recorder.record(it, report)}
        samples = {name: [] for name in logging}
        names = list(logging)
        for rep in range(repetitions + 20):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter_ns()
                logging[name](rep + 1)
                if rep >= 20:
                    samples[name].append(time.perf_counter_ns() - start)
        configs = {name: LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=NON_LOGGING_INTERVAL,
                                      memory_record_dir=folder) for name, folder in settings.items()}
        for cfg in configs.values():
            training_log(NON_LOGGING_INTERVAL, cfg, writers=NullBackend())  # placed: the recorder is open
        iterations = [i for i in range(1, 2 * off_calls) if i % NON_LOGGING_INTERVAL][:off_calls]
        per_round = {name: [] for name in configs}
        for round_ in range(rounds):
            for name in (list(configs) if round_ % 2 else list(configs)[::-1]):
                cfg, start = configs[name], time.perf_counter_ns()
                for iteration in iterations:
                    training_log(iteration, cfg)
                per_round[name].append((time.perf_counter_ns() - start) / len(iterations))
        evidence = HostEvidence()
        beat_ns = per_call_ns(lambda it: recorder.write_liveness({"alive": time.time(), "beats": it, **evidence.read()}),
                              max(100, repetitions))
        record = {"seq": 0, "kind": "step", "time": time.time(), "iteration": 1, "report": report}
        return {"logging": summarise(samples), "off_ns": {name: statistics.median(v) for name, v in per_round.items()},
                "off_calls": len(iterations), "rounds": rounds, "beat_us": beat_ns / 1e3,
                "record_bytes": len(json.dumps(record, separators=(",", ":"))), "report_keys": len(report),
                "slot_bytes": recorder.slot_bytes, "file_bytes": os.path.getsize(recorder.path)}
    finally:
        for monitor in monitors.values():
            monitor.close()
        memory._allocator_stats = saved
        shutil.rmtree(root, ignore_errors=True)


def recorder_markdown(rec: dict) -> list[str]:
    log, off = rec["logging"], rec["off_ns"]
    added = log["log_step_on"]["median_us"] - log["log_step_off"]["median_us"]
    return [
        "", f"Flight recorder (this process, a GPU-like report of {rec['report_keys']} keys: "
        f"{rec['record_bytes']} bytes per record, {rec['slot_bytes']}-byte slots, {rec['file_bytes']} bytes per rank). "
        f"us per call:", "",
        "| | recorder off | recorder on | on/off | added |", "|---|---:|---:|---:|---:|",
        f"| off the logging steps: training_log, median of {rec['rounds']} rounds of {rec['off_calls']} calls "
        f"| {off['off'] / 1e3:.3f} | {off['on'] / 1e3:.3f} | {off['on'] / off['off']:.2f} "
        f"| {(off['on'] - off['off']) / 1e3:+.3f} |",
        f"| a logging step: MemoryMonitor.log_step, no group, median (p90) of {log['log_step_on']['n']} "
        f"| {log['log_step_off']['median_us']:.1f} ({log['log_step_off']['p90_us']:.1f}) "
        f"| {log['log_step_on']['median_us']:.1f} ({log['log_step_on']['p90_us']:.1f}) "
        f"| {log['log_step_on']['median_us'] / log['log_step_off']['median_us']:.2f} | {added:+.1f} |",
        "", f"`record` alone (one json.dumps and one pwrite): {log['record_alone']['median_us']:.1f} us median "
        f"({log['record_alone']['p90_us']:.1f} p90). The liveness thread's beat (its /proc reads and one pwrite, "
        f"about once a second, off the training thread): {rec['beat_us']:.1f} us.",
    ]


# --------------------------------------------------------------------------------------------
# Output.


def markdown(rows: list[dict], non_log: dict | None, writer: dict | None, memory: dict | None, wake: dict,
             command: str, rec: dict | None = None) -> str:
    lines = [
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, Python {sys.version.split()[0]}. "
        f"Command: `{command}`.",
        f"Wake-up penalty: 200 additions take {wake['hot_us']:.1f} us hot and {wake['woken_us']:.1f} us right after "
        f"sleeping {wake['idle_s'] * 1e3:.0f} ms.",
    ]
    if rows:
        lines += [
            "",
            "Per call, microseconds: the largest median (p90) over the ranks, ratios of those medians; "
            + ", ".join(f"PP {r['pp']}: {r['variants']['ours']['n']}" for r in rows)
            + " interleaved repetitions per variant.",
            "",
            "| PP | exchange | a: training_log | reduce: gather_memory | b: bridge | c: composer | d: floor "
            "| a/b | a/c | a/d | reduce/b | reduce/d |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            v = row["variants"]
            cell = {name: f"{v[name]['median_us']:.0f} ({v[name]['p90_us']:.0f})" for name in VARIANTS}
            med = {name: v[name]["median_us"] for name in VARIANTS}
            for mode, ours, reduce in (("all_gather", "ours", "reduce"), ("all_to_all", "ours_a2a", "reduce_a2a")):
                lines.append(
                    f"| {row['pp']} | {mode} | {cell[ours]} | {cell[reduce]} | {cell['bridge']} | {cell['composer']} "
                    f"| {cell['floor']} | {med[ours] / med['bridge']:.2f} | {med[ours] / med['composer']:.3f} "
                    f"| {med[ours] / med['floor']:.2f} | {med[reduce] / med['bridge']:.2f} "
                    f"| {med[reduce] / med['floor']:.2f} |"
                )
        lines += ["", "CPU time per call, this process (all threads), largest median over the ranks, us:", "",
                  "| PP | " + " | ".join(VARIANTS) + " |", "|---:|" + "---:|" * len(VARIANTS)]
        lines += [f"| {r['pp']} | " + " | ".join(f"{r['cpu_us'][name]:.0f}" for name in VARIANTS) + " |" for r in rows]
        lines += [""] + [
            f"PP {r['pp']}: collectives per logging call: {'+'.join(r['collectives_per_logging_call'])} "
            f"(all_to_all: {'+'.join(r['collectives_per_logging_call_a2a'])}); {r['keys_logged']} keys logged; "
            f"all_to_all result identical: {'yes' if r['a2a_identical'] else 'NO'}"
            for r in rows
        ]
        lines += ["", "The pieces of a, one by one, writer rank, us per call: cold = each after a barrier "
                  "(median), as in a logging step; hot = in a tight loop:", "",
                  "| PP | | " + " | ".join(PIECES) + " | sum without all_to_all |",
                  "|---:|---|" + "---:|" * (len(PIECES) + 1)]
        for row in rows:
            for label, p in (("cold", {name: row["pieces"][name]["median_us"] for name in PIECES}),
                             ("hot", row["pieces_hot_us"])):
                total = sum(p.get(name, 0) for name in PIECES if name != "all_to_all")
                lines.append(f"| {row['pp']} | {label} | "
                             + " | ".join(f"{p[name]:.1f}" if name in p else "-" for name in PIECES)
                             + f" | {total:.0f} |")
    if non_log:
        lines += ["", f"Non-logging iteration: training_log off the interval, {non_log['calls']} calls: "
                  f"non_logging_ns_per_call={non_log['ns_per_call']:.0f} "
                  f"({non_log['ns_per_call'] / 1e3:.3f} us, of which the loop {non_log['loop_ns']:.0f} ns), "
                  f"non_logging_collectives={non_log['collectives']}, returned None: {non_log['all_none']}"]
    if writer:
        lines += [
            "", f"Writer rank, {writer['steps']} steps of {writer['keys']} metrics to {', '.join(writer['backends'])}; "
            f"the training thread's work: {writer['work_off']['median_us'] / 1e3:.1f} ms of pure Python "
            f"(median, logging off). ms per step, median (p90):", "",
            "| writer_mode | hand-off (`log`), wall | hand-off, its CPU | training thread's loss, GIL included "
            "| CPU of the trainer's other threads | steps dropped | backend calls failed (retried) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for mode in MODES:
            h, loss, cpu = writer["handoff"][mode], writer["loss"][mode], writer["other_threads_cpu"][mode]
            hc = writer["handoff_cpu"][mode]
            lines.append(f"| {mode} | {h['median_us'] / 1e3:.3f} ({h['p90_us'] / 1e3:.3f}) "
                         f"| {hc['median_us'] / 1e3:.3f} ({hc['p90_us'] / 1e3:.3f}) "
                         f"| {loss['median_us'] / 1e3:.3f} ({loss['p90_us'] / 1e3:.3f}) "
                         f"| {cpu['median_us'] / 1e3:.3f} ({cpu['p90_us'] / 1e3:.3f}) | {writer['dropped'][mode]} "
                         f"| {writer['failures'][mode] or 0} |")
        sync = writer["synchronous"]
        lines += ["", f"The same backends called synchronously: {sync['median_us'] / 1e3:.2f} ms "
                  f"({sync['p90_us'] / 1e3:.2f}) per step. Steps dropped: {sum(writer['dropped'].values())}. "
                  f"Opening the backends took {writer['open_s']:.1f} s, closing them {writer['close_s']:.1f} s "
                  f"(once per run)."]
    if memory:
        off = memory["off"]
        lines += ["", "Writer rank's host memory after 20 logged steps (tests/trainer.py), MB:", "",
                  "| | RSS | peak RSS (VmHWM) | RSS - off | the writer process's own RSS |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {mode} | {m['rss_mb']:.1f} | {m['peak_rss_mb']:.1f} | {m['rss_mb'] - off['rss_mb']:+.1f} "
                  f"| {'-' if m['writer_rss_mb'] is None else format(m['writer_rss_mb'], '.1f')} |"
                  for mode, m in memory.items()]
    if rec:
        lines += recorder_markdown(rec)
    return "\n".join(lines)


def cuda_part(smoke: bool, no_gpu: bool) -> dict:
    """Part 5 (bench_cuda.py): reading the allocator statistics (an H100's, fed through the real
    code, without CUDA); with a GPU (not with --smoke), the logging step against Megatron-Bridge's,
    the floor and queued GPU work, in a spawned process of its own."""
    import bench_cuda

    part = {"statistics": bench_cuda.statistics_part(300 if smoke else 3000)}
    if torch.cuda.is_available() and not (smoke or no_gpu):
        part["gpu"] = bench_cuda.run_gpu_part()
    return part


def cuda_markdown(part: dict) -> list[str]:
    import bench_cuda

    lines = bench_cuda.statistics_markdown(part["statistics"])
    return lines + ([""] + bench_cuda.gpu_markdown(part["gpu"]) if "gpu" in part else [])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="PP 2, few iterations, TensorBoard only")
    parser.add_argument("--pp", type=int, nargs="+", default=None, help="PP sizes (default: 2 4 8)")
    parser.add_argument("--iters", type=int, default=None, help="repetitions per variant (default: 400/300/200)")
    parser.add_argument("--non-logging-calls", type=int, default=None, help="default: 100000")
    parser.add_argument("--writer-steps", type=int, default=None, help="default: 100; 0 skips the writer part")
    parser.add_argument("--backends", default=None, help=f"comma-separated, default: {','.join(BACKENDS)}")
    parser.add_argument("--work-ms", type=float, default=30.0,
                        help="the writer part's training-thread work per step (default: 30)")
    parser.add_argument("--no-memory", action="store_true", help="skip the writer rank's host-memory runs")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU part (bench_cuda.py) where CUDA is present")
    parser.add_argument("--recorder-reps", type=int, default=None, help="default: 2000; 0 skips the recorder part")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args(argv)
    smoke = args.smoke
    sizes = args.pp or ([2] if smoke else [2, 4, 8])
    non_logging_calls = args.non_logging_calls or (20000 if smoke else 100000)
    writer_steps = args.writer_steps if args.writer_steps is not None else (5 if smoke else 100)
    backends = tuple((args.backends or ("tensorboard" if smoke else ",".join(BACKENDS))).split(","))
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")

    from megatron.core import parallel_state  # noqa: F401  (imported once, inherited by the forks)

    started = time.perf_counter()
    wake = wake_penalty(samples=5 if smoke else 15)
    rows, non_log, ranks = [], None, None
    records_root = tempfile.mkdtemp(prefix="nemo_memlog_bench_records_")
    for world in sizes:
        plan = {"iters": args.iters or (20 if smoke else DEFAULT_ITERS.get(world, 200)),
                "warmup": 5 if smoke else 20, "piece_iters": 10 if smoke else 60, "hot_calls": 100 if smoke else 2000,
                "non_logging": non_logging_calls if world == sizes[0] else 0, "records": records_root}
        ranks = run_cluster(world, plan, timeout_s=900)
        rows.append(cluster_row(world, ranks))
        non_log = non_log or ranks[-1].get("non_logging")
        print(f"# PP {world} done after {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    writer = memory = None
    root = tempfile.mkdtemp(prefix="nemo_memlog_bench_")
    try:
        if writer_steps:
            metrics = ranks[-1]["unified"] if ranks else {"memory/peak_reserved_gb": 1.0}
            writer = writer_part(metrics, writer_steps, backends, root, args.work_ms)
            print(f"# writer part done after {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        if not (smoke or args.no_memory):
            memory = host_memory_part(backends, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(records_root, ignore_errors=True)
    recorder_reps = args.recorder_reps if args.recorder_reps is not None else (100 if smoke else 2000)
    rec = recorder_part(recorder_reps, 2000 if smoke else 20000, 5 if smoke else 15) if recorder_reps else None
    cuda = cuda_part(smoke, args.no_gpu)
    command = "python scripts/bench_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(markdown(rows, non_log, writer, memory, wake, command.strip(), rec))
    print("\n" + "\n".join(cuda_markdown(cuda)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "non_logging": non_log, "writer": writer, "memory": memory, "wake": wake,
                       "recorder": rec, "cuda": cuda}, out, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
