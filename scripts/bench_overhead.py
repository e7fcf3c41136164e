"""What nemo_memlog costs per logged step, against the reductions the field uses. ``make bench``.

    python scripts/bench_overhead.py             # PP 2, 4, 8 on gloo, then the non-logging and writer parts
    python scripts/bench_overhead.py --smoke     # PP 2, few iterations, TensorBoard only (tests/test_bench_smoke.py)
    python scripts/bench_overhead.py --pp 2 4 --iters 300 --json out.json
    python scripts/bench_overhead.py --activations-only   # part 9 alone: the activation meter

Part 1, per PP size: the script forks that many processes, joins them in a gloo group and
lets megatron-core's parallel_state build the PP group (world == PP group). Every rank runs
the same sequence: per repetition each variant once, each after a barrier, the first
variant rotating, so that drift and the shared machine's noise hit every variant alike.

    ours      (a) training_log(iteration, cfg) on a logging iteration: report_memory() +
              capacity_report() (/proc reads), the flight record (on, as by default),
              gather_memory (pack, ONE collective, unpack, line up), attribution, and on
              the writer rank the hand-off to a thread-mode
              ThreadFanOut of four BufferedBackends (real buffers and threads; backends that write nothing: the
              real backends, and the writer process, are part 3)
    reduce    gather_memory(report, group) alone: the reduction part of ``ours``
    bridge    (b) Megatron-Bridge's reduce_max_memory_across_pp_group: float64 all_reduce MAX
    composer  (c) Composer's MemoryMonitor: an all_reduce per metric for each of avg, min, max
    floor     (d) one all_reduce of a 1-element tensor
    ours_a2a, reduce_a2a   the same as ours and reduce through a Reduction(exchange="all_to_all")

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
Part 5 (also scripts/bench_cuda.py): reading the allocator statistics (without CUDA: the H100's, fed
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
Part 7 (this process): the memory cgroup limit's reads in capacity_report, and an empty
memory_phase (enter and leave), against report_memory, interleaved.
Part 8 (this process): a logging step with and without the model and optimizer (1,000 parameter
tensors, Adam; the count cached), and the count from scratch.
Part 11 (two torchrun launches, not with --smoke; --megatron-lm-only alone): Megatron-LM's own loop, alone and with
megatron_lm.install(), each logging iteration against the off-interval one before it (scripts/bench/megatron_lm.py).
Part 9 (this process, one thread): the activation meter (nemo_memlog.measure.activations) on a logging
iteration of the demo's model (scripts/demo_model.py's first stage, 4 microbatches in flight, Adam)
and on a 100-layer model, armed and finished against not armed, interleaved; arm() + finish()
alone; and off the logging iterations (no hook left; armed before against never armed).
``--activations-only`` runs this part alone (about a minute).
Part 4 (not with --smoke or --no-memory): tests/trainer.py three times, logging off and in
each mode, with the same backends: the writer rank's host RSS after 20 logged steps.

The tables show for each variant the largest median (and p90) over the ranks, and ratios of
those medians. Nothing here asserts a timing: on a shared machine only ratios taken in one
interleaved run mean something.

The parts live in scripts/bench/, one module each, with their one timing helper.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.activations import activations_markdown, activations_part  # noqa: E402
from bench.composition import composition_markdown, composition_part  # noqa: E402
from bench.cuda import cuda_markdown, cuda_part  # noqa: E402
from bench.flight_recorder import recorder_markdown, recorder_part  # noqa: E402
from bench.host_limit import host_limit_markdown, host_limit_part  # noqa: E402
from bench.host_memory import host_memory_part, memory_markdown  # noqa: E402
from bench.megatron import megatron_markdown, megatron_part  # noqa: E402
from bench.megatron_lm import megatron_lm_markdown, megatron_lm_part  # noqa: E402
from bench.pp_group import (  # noqa: E402
    DEFAULT_ITERS,
    cluster_row,
    non_logging_markdown,
    pp_markdown,
    run_cluster,
)
from bench.stand_ins import BACKENDS  # noqa: E402
from bench.timing import wake_penalty  # noqa: E402
from bench.writer import writer_markdown, writer_part  # noqa: E402
from demo_model import Stage  # noqa: E402  (scripts/, as demo.py imports it)
from nemo_memlog.testing.tmp import private_tmpdir  # noqa: E402


def arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="PP 2, few iterations, TensorBoard only")
    parser.add_argument("--pp", type=int, nargs="+", default=None, help="PP sizes (default: 2 4 8)")
    parser.add_argument("--iters", type=int, default=None, help="repetitions per variant (default: 400/300/200)")
    parser.add_argument("--non-logging-calls", type=int, default=None, help="default: 100000")
    parser.add_argument("--writer-steps", type=int, default=None, help="default: 100; 0 skips the writer part")
    parser.add_argument(
        "--backends", default=None, help=f"comma-separated, default: {','.join(BACKENDS)} (otel: OTLP to a local sink)"
    )
    parser.add_argument(
        "--work-ms", type=float, default=30.0, help="the writer part's training-thread work per step (default: 30)"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the writer rank's host-memory runs")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU part (bench_cuda.py) where CUDA is present")
    parser.add_argument("--recorder-reps", type=int, default=None, help="default: 2000; 0 skips the recorder part")
    parser.add_argument(
        "--activation-reps", type=int, default=None, help="the demo model's repetitions (default: 20); 0 skips part 9"
    )
    parser.add_argument("--activations-only", action="store_true", help="run part 9 (the activation meter) alone")
    parser.add_argument(
        "--megatron-only", action="store_true", help="run part 10 (the meter on megatron-core's GPTModel) alone"
    )
    parser.add_argument(
        "--megatron-lm-only", action="store_true", help="run part 11 (Megatron-LM's own loop, two launches) alone"
    )
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args(argv)
    args.backends = tuple((args.backends or ("tensorboard" if args.smoke else ",".join(BACKENDS))).split(","))
    unknown = set(args.backends) - set(BACKENDS) - {"otel"}
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}, otel")
    return args


def pp_parts(args, records: str, started: float) -> tuple[list, dict | None, list | None]:
    """Parts 1 and 2, per PP size: the table rows, the non-logging numbers, the last size's ranks."""
    smoke = args.smoke
    sizes = args.pp or ([2] if smoke else [2, 4, 8])
    non_logging_calls = args.non_logging_calls or (20000 if smoke else 100000)
    rows, non_log, ranks = [], None, None
    for world in sizes:
        plan = {
            "iters": args.iters or (20 if smoke else DEFAULT_ITERS.get(world, 200)),
            "warmup": 5 if smoke else 20,
            "piece_iters": 10 if smoke else 60,
            "hot_calls": 100 if smoke else 2000,
            "non_logging": non_logging_calls if world == sizes[0] else 0,
            "records": records,
        }
        ranks = run_cluster(world, plan, timeout_s=900)
        rows.append(cluster_row(world, ranks))
        non_log = non_log or ranks[-1].get("non_logging")
        print(f"# PP {world} done after {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return rows, non_log, ranks


def header(wake: dict, command: str) -> list[str]:
    return [
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, Python {sys.version.split()[0]}. "
        f"Command: `{command}`.",
        f"Wake-up penalty: 200 additions take {wake['hot_us']:.1f} us hot and {wake['woken_us']:.1f} us right after "
        f"sleeping {wake['idle_s'] * 1e3:.0f} ms.",
    ]


def activations(args) -> dict | None:
    """Part 9: the activation meter; the 100-layer model runs five times the demo's repetitions."""
    reps = args.activation_reps if args.activation_reps is not None else (2 if args.smoke else 20)
    return activations_part(Stage, reps, 5 * reps, quick=args.smoke) if reps else None


def main(argv=None) -> int:
    args = arguments(argv)
    smoke = args.smoke
    command = "python scripts/bench_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.megatron_only:
        part = megatron_part(2 if args.smoke else 10, quick=args.smoke)
        print("\n".join(megatron_markdown(part)))
        return 0
    if args.megatron_lm_only:
        print("\n".join(megatron_lm_markdown(megatron_lm_part(12 if args.smoke else 60))))
        return 0
    if args.activations_only:
        meter = activations(args)
        print(f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}. Command: `{command.strip()}`.")
        print("\n".join(activations_markdown(meter)))
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"activations": meter}, out, indent=1, default=str)
        return 0
    writer_steps = args.writer_steps if args.writer_steps is not None else (5 if smoke else 100)
    from megatron.core import parallel_state  # noqa: F401  (imported once, inherited by the forks)

    started = time.perf_counter()
    wake = wake_penalty(samples=5 if smoke else 15)
    records_root = tempfile.mkdtemp(prefix="nemo_memlog_bench_records_")
    rows, non_log, ranks = pp_parts(args, records_root, started)
    writer = memory = None
    root = tempfile.mkdtemp(prefix="nemo_memlog_bench_")
    try:
        if writer_steps:
            metrics = ranks[-1]["unified"] if ranks else {"memory/peak_reserved_gb": 1.0}
            writer = writer_part(metrics, writer_steps, args.backends, root, args.work_ms)
            print(f"# writer part done after {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        if not (smoke or args.no_memory):
            memory = host_memory_part(args.backends, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(records_root, ignore_errors=True)
    recorder_reps = args.recorder_reps if args.recorder_reps is not None else (100 if smoke else 2000)
    rec = recorder_part(recorder_reps, 2000 if smoke else 20000, 5 if smoke else 15) if recorder_reps else None
    cuda = cuda_part(smoke, args.no_gpu)
    limit = host_limit_part(200 if smoke else 3000)
    parts = composition_part(20 if smoke else 1000)
    meter = activations(args)
    on_megatron = megatron_part(2 if smoke else 10, quick=smoke)
    on_megatron_lm = None if smoke else megatron_lm_part(60)  # two torchrun launches: not in the smoke run
    lines = header(wake, command.strip()) + pp_markdown(rows) + non_logging_markdown(non_log)
    lines += writer_markdown(writer) + memory_markdown(memory) + recorder_markdown(rec) + host_limit_markdown(limit)
    lines += composition_markdown(parts) + activations_markdown(meter) + megatron_markdown(on_megatron)
    lines += megatron_lm_markdown(on_megatron_lm)
    print("\n".join(lines))
    print("\n" + "\n".join(cuda_markdown(cuda)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "rows": rows,
                    "non_logging": non_log,
                    "writer": writer,
                    "memory": memory,
                    "wake": wake,
                    "recorder": rec,
                    "cuda": cuda,
                    "host_limit": limit,
                    "composition": parts,
                    "activations": meter,
                    "megatron": on_megatron,
                    "megatron_lm": on_megatron_lm,
                },
                out,
                indent=1,
                default=str,
            )
    return 0


if __name__ == "__main__":
    # Every temporary folder this run and its processes make (W&B's among them) goes in one, removed at the end.
    with private_tmpdir(prefix="nemo_memlog_bench_tmp_"):
        sys.exit(main())
