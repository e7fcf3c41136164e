"""Part 3 of the overhead benchmark: the writer rank with real backends, in each writer_mode.

All four backends (or those chosen), in a temp dir: TensorBoard, an MLflow SQLite store, W&B
with WANDB_MODE=offline, a Comet offline archive; in each ``writer_mode``: ``thread`` (the
backends in threads of this process) and ``process`` (in a writer process). Per step, in a
random order, each after a 30 ms sleep: each mode's ``log`` and then a fixed piece of
pure-Python work on this thread, logging off (the work alone), and the backends called
synchronously (for scale). It reports the hand-off (how long ``log`` holds the training
thread) and the loss: hand-off plus work, minus the adjacent logging-off work, so GIL and CPU
contention are included.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

from bench.timing import python_work, rounds_for, summary

MODES = ("thread", "process")
WRITER_SETTLE_S = 0.03  # lets a backend's own background work (W&B's service, Comet's streamer) finish


def backend_config(root: str, name: str, backends: tuple, mode: str = "thread"):
    """A LoggerConfig writing ``backends`` under ``root/name``, in writer_mode ``mode``."""
    from nemo_memlog.config import LoggerConfig

    chosen = {
        "tensorboard": dict(tensorboard_dir=f"{root}/{name}/tensorboard"),
        "wandb": dict(wandb_project="bench", wandb_exp_name=name, wandb_save_dir=f"{root}/{name}"),
        "mlflow": dict(
            mlflow_experiment="bench", mlflow_run_name=name, mlflow_tracking_uri=f"sqlite:///{root}/{name}/mlflow.db"
        ),
        "comet": dict(comet_project="bench", comet_offline_directory=f"{root}/{name}/comet"),
        "otel": dict(otel_metrics=True),  # OTLP over HTTP to otel_sink(), each step exported (the OTEL_* variables)
    }
    fields = {k: v for backend in backends for k, v in chosen[backend].items()}
    return LoggerConfig(log_memory_to_tensorboard=True, writer_mode=mode, **fields)


def writer_part(metrics: dict, steps: int, backends: tuple, root: str, work_ms: float) -> dict:
    """The writer rank with real backends, in each ``writer_mode``, against logging off.

    Every step runs four variants, in a random order, each starting after a 30 ms sleep with
    every backend idle: for each mode, ``log`` then a fixed piece of pure-Python work on this
    (the training) thread, then a flush outside the timing; logging off: the same work alone;
    and, for scale, the backends called synchronously. The loss of a mode is its hand-off plus
    its work, minus the adjacent logging-off work: what the training thread lost to logging
    that step, GIL and CPU contention included."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    sink = otel_sink() if "otel" in backends else None
    try:
        return _writer_part(metrics, steps, backends, root, work_ms)
    finally:
        if sink is not None:
            sink.kill()
            sink.wait()


#: A collector stand-in for the otel backend: a process of its own on 127.0.0.1 that answers every OTLP
#: request 200 (what it costs the writer to export, not what a collector does with it).
SINK = """
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def otel_sink() -> subprocess.Popen:
    """Start the sink and point the OTEL_* variables at it (OTLP over HTTP, one export per step)."""
    sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    port = sink.stdout.readline().strip()
    os.environ.update(
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
    )
    return sink


def _writer_part(metrics: dict, steps: int, backends: tuple, root: str, work_ms: float) -> dict:
    opened = time.perf_counter()
    fanouts, synchronous_backends = _open(metrics, backends, root)
    open_s = time.perf_counter() - opened
    timings = _run_steps(fanouts, synchronous_backends, metrics, steps, rounds_for(work_ms / 1e3))
    stats = {mode: fanout.stats() for mode, fanout in fanouts.items()}
    closed = time.perf_counter()
    for fanout in fanouts.values():
        fanout.close(60)
    for backend in synchronous_backends:
        backend.close()
    handoff, handoff_cpu, busy, others, synchronous = timings
    return {
        "steps": steps,
        "keys": len(metrics),
        "backends": list(backends),
        "work_ms": work_ms,
        "handoff": {mode: summary(handoff[mode]) for mode in MODES},
        "handoff_cpu": {mode: summary(handoff_cpu[mode]) for mode in MODES},
        "loss": {mode: summary([b - o for b, o in zip(busy[mode], busy["off"])]) for mode in MODES},
        "other_threads_cpu": {mode: summary(others[mode]) for mode in MODES},
        "work_off": summary(busy["off"]),
        "synchronous": summary(synchronous),
        "dropped": {mode: sum(s["dropped"] for s in stats[mode].values()) for mode in MODES},
        "failures": {mode: {name: s["failures"] for name, s in stats[mode].items() if s["failures"]} for mode in MODES},
        "open_s": open_s,
        "close_s": time.perf_counter() - closed,
    }


def _open(metrics: dict, backends: tuple, root: str) -> tuple[dict, list]:
    """Each mode's fan-out and the synchronous backends, opened, each having logged step 0."""
    from nemo_memlog.config import flat_params, resolve
    from nemo_memlog.writers import build_writers
    from nemo_memlog.writers.base import backend_module

    for name in ("sync",) + MODES:
        os.makedirs(f"{root}/{name}", exist_ok=True)
    fanouts = {mode: build_writers(backend_config(root, mode, backends, mode)) for mode in MODES}
    for fanout in fanouts.values():
        fanout.log(metrics, 0)  # opens the backends, in their threads (of the writer process)
    sync_cfg = backend_config(root, "sync", backends)
    params = flat_params(sync_cfg)
    synchronous_backends = [backend_module(backend).open_backend(resolve(sync_cfg), params, []) for backend in backends]
    for mode, fanout in fanouts.items():
        if not fanout.flush(180):
            raise RuntimeError(f"the {mode} fan-out's backends did not open: {fanout.stats()}")
    for backend in synchronous_backends:
        backend.log(metrics, 0)
    return fanouts, synchronous_backends


def _run_steps(fanouts: dict, synchronous_backends: list, metrics: dict, steps: int, rounds: int) -> tuple:
    """Every step's variants in a random order, each after a sleep; the raw samples (ns)."""
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
    return handoff, handoff_cpu, busy, others, synchronous


def writer_markdown(writer: dict | None) -> list[str]:
    """Part 3's table: per mode, the hand-off and the training thread's loss."""
    if not writer:
        return []
    lines = [
        "",
        f"Writer rank, {writer['steps']} steps of {writer['keys']} metrics to {', '.join(writer['backends'])}; "
        f"the training thread's work: {writer['work_off']['median_us'] / 1e3:.1f} ms of pure Python "
        f"(median, logging off). ms per step, median (p90):",
        "",
        "| writer_mode | hand-off (`log`), wall | hand-off, its CPU | training thread's loss, GIL included "
        "| CPU of the trainer's other threads | steps dropped | backend calls failed (retried) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        h, loss, cpu = writer["handoff"][mode], writer["loss"][mode], writer["other_threads_cpu"][mode]
        hc = writer["handoff_cpu"][mode]
        lines.append(
            f"| {mode} | {h['median_us'] / 1e3:.3f} ({h['p90_us'] / 1e3:.3f}) "
            f"| {hc['median_us'] / 1e3:.3f} ({hc['p90_us'] / 1e3:.3f}) "
            f"| {loss['median_us'] / 1e3:.3f} ({loss['p90_us'] / 1e3:.3f}) "
            f"| {cpu['median_us'] / 1e3:.3f} ({cpu['p90_us'] / 1e3:.3f}) | {writer['dropped'][mode]} "
            f"| {writer['failures'][mode] or 0} |"
        )
    sync = writer["synchronous"]
    lines += [
        "",
        f"The same backends called synchronously: {sync['median_us'] / 1e3:.2f} ms "
        f"({sync['p90_us'] / 1e3:.2f}) per step. Steps dropped: {sum(writer['dropped'].values())}. "
        f"Opening the backends took {writer['open_s']:.1f} s, closing them {writer['close_s']:.1f} s "
        f"(once per run).",
    ]
    return lines
