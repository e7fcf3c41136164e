"""Part 10: what the activation meter costs on a logging iteration of megatron-core's own model.

One process (world 1, gloo, one thread): megatron-core's ``GPTModel`` (local spec) in its
``DistributedDataParallel`` with its Adam, through ``nemo_memlog.testing.megatron.cpu`` (the CPU
stand-ins); one iteration is ``get_forward_backward_func()``'s schedule over the microbatches and the
optimizer step. With the meter armed before and finished after, against the same iteration without
it, interleaved (each variant once a repetition, the first rotating); the median of the
per-repetition ratios besides each variant's median.
"""

from __future__ import annotations

import os
import statistics

from .timing import interleaved, summarise

#: The model and batch: large enough that an iteration is compute, small enough for 2 cores.
SHAPE = {"pp": 1, "layers": 4, "hidden": 256, "heads": 8, "seq": 256, "vocab": 1024, "micro_batch_size": 4}
MICROBATCHES = 4


def megatron_part(repetitions: int, quick: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    from nemo_memlog.measure import host_idle
    from nemo_memlog.measure.activations import ActivationMeter
    from nemo_memlog.testing.cluster import free_port
    from nemo_memlog.testing.megatron import cpu as megatron_cpu

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        shape = {**SHAPE, "seq": 64, "hidden": 64, "heads": 4} if quick else SHAPE
        job = megatron_cpu.build(megatron_cpu.JobSpec(**shape, microbatches=MICROBATCHES))
        meter = ActivationMeter()
        seen = {}

        def iteration(armed: bool, idle: bool = True):
            if armed:
                meter.arm(job.model)
            read = host_idle.idle_rss_gb
            if not idle:  # the meter without the idle size's read (measure/host_idle.py: mallinfo2 and /proc)
                host_idle.idle_rss_gb = lambda: None
            try:
                job.train_iteration()
            finally:
                host_idle.idle_rss_gb = read
            if armed:
                seen["measured"] = meter.finish()

        variants = {
            "megatron_meter": lambda _: iteration(True),
            "megatron_meter_no_idle": lambda _: iteration(True, idle=False),
            "megatron_plain": lambda _: iteration(False),
        }
        wall, _ = interleaved(variants, repetitions, warmup=1 if quick else 2)
    finally:
        torch.set_num_threads(threads)
        if started:
            dist.destroy_process_group()
    measured = seen.get("measured")
    return {
        "quick": quick,
        "shape": shape,
        "microbatches": MICROBATCHES,
        "activations_gb": None if measured is None else measured.activations_gb,
        "paired": statistics.median(a / b for a, b in zip(wall["megatron_meter"], wall["megatron_plain"])),
        "paired_idle": statistics.median(a / b for a, b in zip(wall["megatron_meter"], wall["megatron_meter_no_idle"])),
        **summarise(wall),
    }


def megatron_markdown(part: dict | None) -> list[str]:
    if not part:
        return []
    with_ms, without_ms = part["megatron_meter"]["median_us"] / 1e3, part["megatron_plain"]["median_us"] / 1e3
    shape = part["shape"]
    return [
        "",
        "Activation meter on megatron-core's GPTModel (this process, world 1, 1 thread), ms per logging "
        "iteration, median, interleaved:",
        "",
        "| model | with the meter | without | overhead | paired ratio (median) | n |",
        "|---|---:|---:|---:|---:|---:|",
        f"| GPTModel {shape['layers']} layers, hidden {shape['hidden']}, seq {shape['seq']}, "
        f"{part['microbatches']} x {shape['micro_batch_size']} sequences, DDP + Adam "
        f"| {with_ms:.1f} | {without_ms:.1f} | {100 * (with_ms / without_ms - 1):+.1f}% | x{part['paired']:.3f} "
        f"| {part['megatron_meter']['n']} |",
        "",
        f"The meter measured {part['activations_gb'] or 0:.4f} GB of activations on that iteration.",
        "",
        f"The idle size's read (on CPU, once per measured iteration: mallinfo2 and one /proc read, "
        f"measure/host_idle.py): the meter with it against the meter without, paired ratio (median) "
        f"x{part['paired_idle']:.3f}; medians {with_ms:.1f} against "
        f"{part['megatron_meter_no_idle']['median_us'] / 1e3:.1f} ms.",
    ]
