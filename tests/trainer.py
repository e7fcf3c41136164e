"""A small training process for the writer-process tests: every rank calls training_log
every step, and the writer rank prints ``handed <step>`` once the call has returned (in thread mode
then ``written <backend>=<steps> ...``, the fan-out's count of the steps each backend has written).

    python tests/trainer.py ROOT [--mode process|thread|off] [--steps N] [--end close|os_exit]
    torchrun --nproc-per-node 2 tests/trainer.py ROOT --steps 0    # runs until killed

All four backends write under ROOT (TensorBoard, an MLflow SQLite store, W&B offline, a
Comet offline archive), as in the demo; ``--backends`` picks fewer, ``--mlflow-uri`` points
MLflow elsewhere. Every rank joins a gloo group (of one without torchrun), which is the
pipeline group. At the end the writer rank waits until every backend (or those named by
``--wait-for``) has written every step, prints one JSON line (host RSS now and peak, in MB,
and the writer process's pid and RSS), then closes the writers, or with ``--end os_exit`` dies on
the spot.
"""

import argparse
import json
import os
import sys
import time

BACKENDS = ("tensorboard", "mlflow", "wandb", "comet")


def logger_config(root: str, mode: str, backends, mlflow_uri: str | None, close_timeout_s: float):
    from nemo_memlog import LoggerConfig

    fields = {
        "tensorboard": dict(tensorboard_dir=f"{root}/tensorboard"),
        "mlflow": dict(
            mlflow_experiment="trainer",
            mlflow_run_name="run",
            mlflow_tracking_uri=mlflow_uri or f"sqlite:///{root}/mlflow.db",
        ),
        "wandb": dict(wandb_project="trainer", wandb_exp_name="run", wandb_save_dir=root),
        "comet": dict(comet_project="trainer", comet_offline_directory=f"{root}/comet"),
        "otel": dict(otel_metrics=True),  # configured by OTEL_* variables; not among the default backends
    }
    chosen = {key: value for name in backends for key, value in fields[name].items()}
    return LoggerConfig(
        log_memory_to_tensorboard=mode != "off",
        writer_mode="thread" if mode == "thread" else "process",
        writer_close_timeout_s=close_timeout_s,
        **chosen,
    )


def host_memory_mb(pid="self") -> dict:
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024}


def wait_written(writers, names, steps: int, timeout_s: float = 180) -> None:
    """Until each backend in ``names`` has written ``steps`` steps (the others may hang)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = writers.stats()
        if all(stats[name]["written"] >= steps for name in names):
            return
        time.sleep(0.1)
    print(f"not written in time: {writers.stats()}", file=sys.stderr, flush=True)


def wait_for_file(path: str, timeout_s: float = 180) -> None:
    """Until ``path`` exists (the test has read what it needs from the live writers)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--mode", choices=("process", "thread", "off"), default="process")
    parser.add_argument("--steps", type=int, default=20, help="0: until killed")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--mlflow-uri", default=None)
    parser.add_argument("--close-timeout", type=float, default=30.0)
    parser.add_argument("--end", choices=("close", "os_exit"), default="close")
    parser.add_argument(
        "--hold", default=None, help="a file: once every step is written, wait until it exists, then end"
    )
    parser.add_argument(
        "--wait-for",
        default=None,
        help="backends that must have written every step before the end (default: all of them)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.makedirs(args.root, exist_ok=True)

    import torch
    import torch.distributed as dist

    from nemo_memlog import build_writers, training_log

    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"file://{args.root}/rendezvous", rank=0, world_size=1)
    writer_rank = dist.get_rank() == dist.get_world_size() - 1
    cfg = logger_config(args.root, args.mode, args.backends.split(","), args.mlflow_uri, args.close_timeout)
    writers = build_writers(cfg) if writer_rank and args.mode != "off" else None
    if writer_rank:
        print(f"trainer {os.getpid()} writer {getattr(writers, 'pid', None)}", flush=True)
    weights = torch.randn(256, 256)
    step = 0
    while args.steps == 0 or step < args.steps:
        step += 1
        loss = float((weights @ weights).abs().mean())  # a little work per step
        training_log(step, cfg, pp_group=dist.group.WORLD, writers=writers, metrics={"loss": loss})
        if writer_rank:
            print(f"handed {step}", flush=True)
            if args.mode == "thread":  # which backends have opened and written (the fan-out's own count)
                written = {name: stats["written"] for name, stats in writers.stats().items()}
                print("written " + " ".join(f"{name}={count}" for name, count in written.items()), flush=True)
        time.sleep(0.02)
    if writer_rank:
        if writers is not None:
            wait_written(writers, args.wait_for.split(",") if args.wait_for else list(writers.stats()), step)
        writer_pid = getattr(writers, "pid", None)
        writer_rss_mb = host_memory_mb(writer_pid)["rss_mb"] if writer_pid else None
        print(json.dumps({**host_memory_mb(), "writer_pid": writer_pid, "writer_rss_mb": writer_rss_mb}), flush=True)
        if args.hold:
            wait_for_file(args.hold)
        if args.end == "os_exit":
            os._exit(0)
        if writers is not None:
            writers.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
