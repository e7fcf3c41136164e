"""Part 6 of the overhead benchmark: the flight recorder on and off, in this process.

The recorder adds no collective, so one process shows its cost: ``memory_record_dir`` a temp
dir, or "off", with the GPU-like report. Off the logging steps: training_log at off-interval
iterations, each variant a tight loop of calls per round, rounds interleaved. On a logging
step: MemoryMonitor.log_step without a group (report, record, attribution, hand-off to a
writer that does nothing), each call timed alone, variants in a rotating order; and ``record``
alone. Also the liveness thread's beat (the /proc reads and one pwrite), about once a second.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

from bench.pp_group import NON_LOGGING_INTERVAL
from bench.stand_ins import NullBackend, fed_statistics, h100_cuda_stats
from bench.timing import interleaved, per_call_ns, summarise


def recorder_part(repetitions: int, off_calls: int, rounds: int) -> dict:
    """The recorder's cost off and on the logging steps, in this process (no group: it adds no
    collective). Variants interleaved; medians in us, and the on/off ratios."""
    root = tempfile.mkdtemp(prefix="nemo_memlog_bench_records_")
    try:
        with fed_statistics(h100_cuda_stats(0)):  # a GPU-like report: the record's real size
            return _measure({"off": "off", "on": root}, repetitions, off_calls, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _measure(folders: dict, repetitions: int, off_calls: int, rounds: int) -> dict:
    from nemo_memlog.config import LoggerConfig
    from nemo_memlog.monitor import MemoryMonitor
    from nemo_memlog.rank import memory

    monitors = {
        name: MemoryMonitor(
            LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir=folder), writers=NullBackend()
        )
        for name, folder in folders.items()
    }
    try:
        for monitor in monitors.values():
            monitor.place()
        recorder = monitors["on"].recorder
        report = memory.report_memory()  # this rank's report, as a logging step has it
        report.update(memory.capacity_report())
        logging = {
            "log_step_off": monitors["off"].log_step,
            "log_step_on": monitors["on"].log_step,
            "record_alone": lambda it: recorder.record(it, report),
        }
        samples = interleaved(logging, repetitions, 20)[0]
        off_ns, off_count = _off_the_logging_steps(folders, off_calls, rounds)
        record = {"seq": 0, "kind": "step", "time": time.time(), "iteration": 1, "report": report}
        return {
            "logging": summarise(samples),
            "off_ns": off_ns,
            "off_calls": off_count,
            "rounds": rounds,
            "beat_us": _beat_ns(recorder, repetitions) / 1e3,
            "record_bytes": len(json.dumps(record, separators=(",", ":"))),
            "report_keys": len(report),
            "slot_bytes": recorder.slot_bytes,
            "file_bytes": os.path.getsize(recorder.path),
        }
    finally:
        for monitor in monitors.values():
            monitor.close()


def _off_the_logging_steps(folders: dict, off_calls: int, rounds: int) -> tuple[dict, int]:
    """training_log at off-interval iterations, recorder off and on: the median ns per call over
    ``rounds`` rounds (each a tight loop, the variants' order alternating), and the calls per round."""
    from nemo_memlog.config import LoggerConfig
    from nemo_memlog.monitor.training_log import training_log

    configs = {
        name: LoggerConfig(
            log_memory_to_tensorboard=True, tensorboard_log_interval=NON_LOGGING_INTERVAL, memory_record_dir=folder
        )
        for name, folder in folders.items()
    }
    for cfg in configs.values():
        training_log(NON_LOGGING_INTERVAL, cfg, writers=NullBackend())  # placed: the recorder is open
    iterations = [i for i in range(1, 2 * off_calls) if i % NON_LOGGING_INTERVAL][:off_calls]
    per_round = {name: [] for name in configs}
    for round_ in range(rounds):
        for name in list(configs) if round_ % 2 else list(configs)[::-1]:
            cfg, start = configs[name], time.perf_counter_ns()
            for iteration in iterations:
                training_log(iteration, cfg)
            per_round[name].append((time.perf_counter_ns() - start) / len(iterations))
    return {name: statistics.median(v) for name, v in per_round.items()}, len(iterations)


def _beat_ns(recorder, repetitions: int) -> float:
    """The liveness thread's beat: its /proc and cgroup reads and one pwrite, ns."""
    from nemo_memlog.failure.evidence import HostEvidence

    evidence = HostEvidence()
    return per_call_ns(
        lambda it: recorder.write_liveness({"alive": time.time(), "beats": it, **evidence.read()}),
        max(100, repetitions),
    )


def recorder_markdown(rec: dict | None) -> list[str]:
    """Part 6's table and lines."""
    if not rec:
        return []
    log, off = rec["logging"], rec["off_ns"]
    added = log["log_step_on"]["median_us"] - log["log_step_off"]["median_us"]
    return [
        "",
        f"Flight recorder (this process, a GPU-like report of {rec['report_keys']} keys: "
        f"{rec['record_bytes']} bytes per record, {rec['slot_bytes']}-byte slots, {rec['file_bytes']} bytes per rank). "
        f"us per call:",
        "",
        "| | recorder off | recorder on | on/off | added |",
        "|---|---:|---:|---:|---:|",
        f"| off the logging steps: training_log, median of {rec['rounds']} rounds of {rec['off_calls']} calls "
        f"| {off['off'] / 1e3:.3f} | {off['on'] / 1e3:.3f} | {off['on'] / off['off']:.2f} "
        f"| {(off['on'] - off['off']) / 1e3:+.3f} |",
        f"| a logging step: MemoryMonitor.log_step, no group, median (p90) of {log['log_step_on']['n']} "
        f"| {log['log_step_off']['median_us']:.1f} ({log['log_step_off']['p90_us']:.1f}) "
        f"| {log['log_step_on']['median_us']:.1f} ({log['log_step_on']['p90_us']:.1f}) "
        f"| {log['log_step_on']['median_us'] / log['log_step_off']['median_us']:.2f} | {added:+.1f} |",
        "",
        f"`record` alone (one json.dumps and one pwrite): {log['record_alone']['median_us']:.1f} us median "
        f"({log['record_alone']['p90_us']:.1f} p90). The liveness thread's beat (its /proc reads and one pwrite, "
        f"about once a second, off the training thread): {rec['beat_us']:.1f} us.",
    ]
