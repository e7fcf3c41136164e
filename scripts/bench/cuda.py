"""Part 5 of the overhead benchmark (and all of scripts/bench_cuda.py): reading the allocator
statistics, and with a GPU, a logging step against Megatron-Bridge's, the floor, and a logging
step behind queued GPU work.

Statistics (every call interleaved with the others, median and p90): ``report_memory`` (ours:
torch's nested statistics read once, the names resolved to paths once), Megatron-Bridge's
``report_memory`` (``torch.cuda.memory_stats()``: the same nested dict flattened and sorted in
Python), ``torch.cuda.memory_stats()`` alone, the host RSS read (/proc/self/status) and
``capacity_report`` (/proc/meminfo). Without CUDA the statistics an H100 gave (122 of them)
are fed through the same code (``stand_ins.fed_statistics``); what is then not measured is the
C++ call that builds the dict, and ``mem_get_info`` (the GPU part measures both).

The GPU part, in a spawned process of its own, NCCL in a world of one, with 2 GB of tensors held:
- the same statistics, read for real, and their pieces (the nested read, ``mem_get_info``);
- a logging step's work (report_memory, capacity_report, gather_memory, attribution) over
  the gloo twin (``memory_reduce_backend`` auto/gloo) and over the NCCL group itself
  ("group"), Megatron-Bridge's ``report_memory()`` + its float64 all_reduce MAX on the GPU,
  and the floors: a 1-element all_reduce + synchronize on NCCL, and on gloo. A world of one
  is the only NCCL world one GPU allows (NCCL refuses two ranks on one GPU); the gathers and
  all-reduces are called directly, since ``takes_part`` skips a group of one;
- the same steps with ``queued_ms`` of matmuls queued on the stream first: how long the
  call takes, whether the queue was still running when it returned, and when it drained.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

import torch

from bench.anchors import bridge_all_reduce_max, bridge_report_memory
from bench.stand_ins import fed_statistics, h100_statistics
from bench.timing import interleaved, per_call_ns, summarise

GB = 1e9


def cuda_part(smoke: bool, no_gpu: bool) -> dict:
    """Part 5: the statistics (an H100's, fed through the real code, without CUDA); with a GPU
    (not with ``smoke`` or ``no_gpu``), the GPU part, in a spawned process of its own."""
    part = {"statistics": statistics_part(300 if smoke else 3000)}
    if torch.cuda.is_available() and not (smoke or no_gpu):
        part["gpu"] = run_gpu_part()
    return part


def cuda_markdown(part: dict) -> list[str]:
    lines = statistics_markdown(part["statistics"])
    return lines + ([""] + gpu_markdown(part["gpu"]) if "gpu" in part else [])


# ------------------------------------------------------------------------------------------
# Statistics.


def statistics_variants(on_gpu: bool) -> dict:
    from nemo_memlog.rank import memory

    variants = {
        "report_memory": lambda it: memory.report_memory(),
        "bridge_report_memory": lambda it: bridge_report_memory(),
        "torch_memory_stats": lambda it: torch.cuda.memory_stats(),
        "host_rss": lambda it: memory.host_rss_bytes(),
        "capacity_report": lambda it: memory.capacity_report(),
    }
    if on_gpu:
        device = torch.cuda.current_device()
        cudart = torch.cuda.cudart()
        nested_read = torch._C._cuda_memoryStats  # what report_memory reads: the nested dict, from C++
        variants["nested_read"] = lambda it: nested_read(device)
        variants["mem_get_info"] = lambda it: torch.cuda.mem_get_info(device)
        variants["cudaMemGetInfo"] = lambda it: cudart.cudaMemGetInfo(device)
        variants["reference"] = plain_reference(device)
    return variants


def plain_reference(device: int):
    """The floor of this design, as plainly as it can be written: the 11 default statistics by
    path from one nested read, mem_get_info, and the /proc/self/status read and parse."""
    from nemo_memlog.rank.memory import DEFAULT_MEMORY_KEYS

    paths = [(name, tuple(stat.split(".")), "bytes" in stat) for stat, name in DEFAULT_MEMORY_KEYS.items()]
    status = os.open("/proc/self/status", os.O_RDONLY)
    read = torch._C._cuda_memoryStats

    def reference(iteration):
        stats = read(device)
        report = {}
        for name, path, in_bytes in paths:
            value = stats
            for part in path:
                value = value[part]
            report[name] = value / GB if in_bytes else value
        free, total = torch.cuda.mem_get_info(device)
        text = os.pread(status, 16384, 0)
        start = text.index(b"VmRSS:") + 6
        report["host_rss_gb"] = int(text[start : text.index(b"kB", start)]) * 1024 / GB
        start = text.index(b"VmHWM:") + 6
        report["peak_host_rss_gb"] = int(text[start : text.index(b"kB", start)]) * 1024 / GB
        report["device_used_gb"] = (total - free) / GB
        return report

    return reference


def hot(variants: dict, calls: int = 1000, repeats: int = 3) -> dict:
    """Each variant in a tight loop (best of ``repeats`` loops of ``calls``), us per call."""
    return {name: per_call_ns(variant, calls, repeats) / 1e3 for name, variant in variants.items()}


def statistics_part(reps: int) -> dict:
    """The statistics on this machine: real ones with CUDA in use, else the H100's fed through."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        variants = statistics_variants(True)
        return {"source": "this GPU", "calls": summarise(interleaved(variants, reps)[0]), "hot_us": hot(variants)}
    with fed_statistics(h100_statistics()):
        variants = statistics_variants(False)
        return {
            "source": "an H100's statistics fed through (tests/data)",
            "calls": summarise(interleaved(variants, reps)[0]),
            "hot_us": hot(variants, max(100, reps // 3)),
        }


def statistics_markdown(part: dict) -> list[str]:
    calls = part["calls"]
    ours = calls["report_memory"]["median_us"]
    hot_us = part["hot_us"]
    lines = [
        f"Allocator statistics, {part['source']}: us per call, median (p90) of "
        f"{calls['report_memory']['n']} interleaved calls each; hot: best tight loop:",
        "",
        "| call | interleaved, median (p90) | / report_memory | hot | / report_memory |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in calls.items():
        lines.append(
            f"| {name} | {s['median_us']:.1f} ({s['p90_us']:.1f}) | {s['median_us'] / ours:.2f} "
            f"| {hot_us[name]:.1f} | {hot_us[name] / hot_us['report_memory']:.2f} |"
        )
    return lines


# ------------------------------------------------------------------------------------------
# The GPU part: NCCL, world of one.


def run_gpu_part(reps: int = 3000, queued_ms: float = 300, queued_reps: int = 6) -> dict:
    """gpu_part in a fresh spawned process (never CUDA in a process that forks the CPU benchmark)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_gpu_child, args=(reps, queued_ms, queued_reps, results), daemon=True)
    process.start()
    status, value = results.get(timeout=900)
    process.join(timeout=60)
    if status != "ok":
        raise RuntimeError(f"the GPU part failed:\n{value}")
    return value


def _gpu_child(reps, queued_ms, queued_reps, results):
    try:
        results.put(("ok", gpu_part(reps, queued_ms, queued_reps)))
    except BaseException as error:
        results.put(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def gpu_part(reps: int, queued_ms: float, queued_reps: int) -> dict:
    """Run in a spawned process: NCCL world of one on device 0. Every number of the GPU part."""
    import torch.distributed as dist

    from nemo_memlog import reduce
    from nemo_memlog.testing.cluster import free_port

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    held = [torch.ones(int(GB) // 4, device="cuda") for _ in range(2)]  # 2 GB in 2 segments: real statistics
    out = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "python": sys.version.split()[0],
    }
    out["statistics"] = statistics_part(reps)
    world = dist.group.WORLD
    twin = reduce.reduction_group(world, backend="gloo", world_scope=True, timeout_s=300)
    steps = _gpu_steps(world, twin)
    out["steps"] = summarise(interleaved(steps, reps // 3)[0])
    out["queued"] = _queued(steps, queued_ms, queued_reps)
    del held
    dist.destroy_process_group()
    return out


def _gpu_steps(world, twin) -> dict:
    """A logging step's work over the gloo twin and over NCCL, Bridge's, and the two floors."""
    import torch.distributed as dist

    from nemo_memlog import attribution, reduce
    from nemo_memlog.rank import memory

    one_gpu, one_cpu = torch.zeros(1, device="cuda"), torch.zeros(1)

    def logging_step(group):
        def run(iteration):
            report = memory.report_memory()
            report.update(memory.capacity_report())
            gathered = reduce.gather_memory(report, group, iteration=iteration, timeout_s=300)
            return attribution.memory_metrics(gathered, ("peak_*", "device_used_gb", "device_other_gb"))

        return run

    def floor_nccl(iteration):
        dist.all_reduce(one_gpu, group=world)
        torch.cuda.synchronize()

    return {
        "ours_gloo": logging_step(twin),
        "ours_nccl": logging_step(world),
        "bridge": lambda it: bridge_all_reduce_max(bridge_report_memory(), world, "cuda"),
        "floor_nccl": floor_nccl,
        "floor_gloo": lambda it: dist.all_reduce(one_cpu, group=twin),
    }


def _queued(steps: dict, queued_ms: float, queued_reps: int) -> dict:
    """Our two logging steps and Bridge's, each right after ``queued_ms`` of matmuls were queued."""
    from nemo_memlog.testing.gpu_work import QueuedWork, still_busy

    work = QueuedWork()
    queued = {
        name: {"call_ms": [], "drained_ms": [], "busy": 0, "queued_ms": []}
        for name in ("ours_gloo", "ours_nccl", "bridge")
    }
    iteration = 10**6
    for rep in range(queued_reps):
        for name in list(queued)[rep % 3 :] + list(queued)[: rep % 3]:
            iteration += 1
            torch.cuda.synchronize()
            estimate = work.queue(queued_ms / 1e3)
            start = time.perf_counter()
            steps[name](iteration)
            called = time.perf_counter()
            busy = still_busy()
            torch.cuda.synchronize()
            record = queued[name]
            record["call_ms"].append((called - start) * 1e3)
            record["drained_ms"].append((time.perf_counter() - start) * 1e3)
            record["busy"] += busy
            record["queued_ms"].append(estimate * 1e3)
    return {
        name: {
            "call_ms": statistics.median(r["call_ms"]),
            "drained_ms": statistics.median(r["drained_ms"]),
            "queued_ms": statistics.median(r["queued_ms"]),
            "busy": r["busy"],
            "n": queued_reps,
        }
        for name, r in queued.items()
    }


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def gpu_markdown(gpu: dict) -> list[str]:
    lines = [
        f"GPU: {gpu['device']}, torch {gpu['torch']}, CUDA {gpu['cuda']}, NCCL {gpu['nccl']}, "
        f"Python {gpu['python']}; NCCL world of one.",
        "",
    ]
    lines += statistics_markdown(gpu["statistics"])
    steps = gpu["steps"]
    floor = steps["floor_nccl"]["median_us"]
    lines += [
        "",
        f"A logging step's work, idle GPU, us per call, median (p90), {steps['ours_gloo']['n']} "
        "interleaved calls each:",
        "",
        "| variant | median (p90) | / bridge | / floor_nccl |",
        "|---|---:|---:|---:|",
    ]
    for name, s in steps.items():
        lines.append(
            f"| {name} | {s['median_us']:.1f} ({s['p90_us']:.1f}) "
            f"| {s['median_us'] / steps['bridge']['median_us']:.2f} | {s['median_us'] / floor:.2f} |"
        )
    lines += [
        "",
        "The same steps with matmuls queued on the stream first (median of "
        f"{next(iter(gpu['queued'].values()))['n']}), ms:",
        "",
        "| variant | queued | the call | queue still running when it returned | call + drain |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, q in gpu["queued"].items():
        lines.append(
            f"| {name} | {q['queued_ms']:.0f} | {q['call_ms']:.2f} | {q['busy']}/{q['n']} | {q['drained_ms']:.0f} |"
        )
    return lines
