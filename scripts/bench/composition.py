"""Part 8: what passing the model and optimizer adds to a logging step (this process).

A model of 1,000 parameter tensors (500 Linear(32, 32) layers) with Adam after one step (2,000
state tensors and 500 step tensors more), on CPU. Interleaved, each variant once a repetition:
MemoryMonitor.log_step without a group and without a model (today's logging step), with the model
(the count cached: composition.ModelState's fingerprint only); then, apart, the count from
scratch (``report_model_state``).
"""

from __future__ import annotations

from .timing import interleaved, summarise

LAYERS = 500


def composition_part(repetitions: int) -> dict:
    import torch

    from nemo_memlog.config import LoggerConfig
    from nemo_memlog.measure.composition import report_model_state
    from nemo_memlog.monitor import MemoryMonitor

    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(LAYERS)))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 32)).sum().backward()
    optimizer.step()

    class Quiet:
        backend_names = ()

        def log(self, metrics, step):
            pass

        def flush(self):
            pass

    monitor = MemoryMonitor(LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir="off"), writers=Quiet())
    variants = {
        "log_step": lambda rep: monitor.log_step(rep),
        "log_step_model": lambda rep: monitor.log_step(rep, model=model, optimizer=optimizer),
    }
    wall, _ = interleaved(variants, repetitions, warmup=10)
    # Apart: a 20 ms walk over 3,500 tensors would leave the variant after it cache-cold.
    scratch, _ = interleaved({"count_from_scratch": lambda _: report_model_state(model, optimizer)}, 50, warmup=2)
    monitor.close()
    return {"tensors": len(list(model.parameters())), **summarise(wall), **summarise(scratch)}


def composition_markdown(part: dict | None) -> list[str]:
    if not part:
        return []
    base, with_model = part["log_step"]["median_us"], part["log_step_model"]["median_us"]
    return [
        "",
        f"Model composition (this process; {part['tensors']} parameter tensors with Adam), us per call, "
        "median (p90), interleaved:",
        "",
        "| | median | p90 |",
        "|---|---:|---:|",
        f"| a logging step, no model (MemoryMonitor.log_step, no group) | {base:.1f} "
        f"| {part['log_step']['p90_us']:.1f} |",
        f"| the same with model and optimizer (count cached) | {with_model:.1f} | "
        f"{part['log_step_model']['p90_us']:.1f} |",
        f"| counting from scratch (report_model_state) | {part['count_from_scratch']['median_us']:.1f} | "
        f"{part['count_from_scratch']['p90_us']:.1f} |",
        "",
        f"With the model: x{with_model / base:.2f} ({with_model - base:+.1f} us).",
    ]
