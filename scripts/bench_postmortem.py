"""How long `nemo-memlog postmortem` takes, from 512 to 4,096 ranks.

For each world size, one process writes every rank's flight record with the recorder's own
code (nemo_memlog/testing/flight_sim.py: FlightRecorder, with the coordinates of the rank it plays):
PP 8 x TP 8 x DP (world / 64), Megatron-Core's rank order, 8 ranks a node (node-000..511 at
4,096 ranks), the default ring (16 slots of 2 KB), 16 step records per rank. The scenario: one
rank is SIGKILLed by the OOM killer (no end marker; its host's oom_kill counter goes up), its
7 node-mates are killed 1-2 s later, every other rank ends through our SIGTERM handler.

Then the command runs as a user runs it, a fresh ``python -m nemo_memlog.cli postmortem`` process
(interpreter start and imports included), in three variants: the text without the PNG
(``--no-png``), ``--json`` (a failure hook), and the text with the PNG. Sizes and variants are
interleaved: each repetition runs every (size, variant) once, in an order that rotates. The
files are in the page cache (written just before), as on the cluster right after a failure.
Every run's JSON is checked: the killed rank is the first failure.

    python scripts/bench_postmortem.py                 # 512, 1024, 2048, 4096; 3 repetitions
    python scripts/bench_postmortem.py --smoke         # 64 ranks, 1 repetition, no PNG (tests/test_postmortem.py)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nemo_memlog.testing.flight_sim import layout, write_run  # noqa: E402

VARIANTS = {"text, no PNG": ["--no-png"], "--json": ["--json"], "text + PNG": []}
TARGET_S = 10.0


def scenario(world: int, seed: int = 0):
    """The ranks of one run, and the rank the OOM killer took."""
    pp, tp = 8, 8
    ranks = layout(pp=pp, tp=tp, dp=world // (pp * tp))
    random.seed(seed)
    stopped = time.time() - 600.0
    victim = ranks[world // 2 + 3]
    for rank in ranks:
        rank.iterations = list(range(1000, 1160, 10))  # 16 step records: the ring is full
        rank.peak_reserved_gb = 60.0 + 12.0 * (pp - 1 - rank.pp) / (pp - 1) + random.random()
        rank.vmstat_oom_kill, rank.stopped, rank.end = 0, stopped + 3.0 + random.random(), "sigterm"
    for mate in ranks:
        if mate.host == victim.host:
            mate.end, mate.stopped, mate.vmstat_oom_kill = None, stopped + 1.0 + random.random(), 1
    victim.stopped, victim.vmstat_oom_kill, victim.host_available_gb, victim.host_rss_gb = stopped, 0, 0.3, 61.0
    return ranks, victim.rank


def time_command(run_dir: Path, extra: list[str], png: Path) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (user + system: what load on the machine does not inflate), stdout."""
    argv = [sys.executable, "-m", "nemo_memlog.cli", "postmortem", str(run_dir), *extra]
    if not extra:
        argv += ["--png", str(png)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cpu_before = _children_cpu()
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    elapsed = time.perf_counter() - started
    cpu = _children_cpu() - cpu_before
    if done.returncode != 1:
        raise SystemExit(f"postmortem exited {done.returncode} (expected 1: a failure):\n{done.stderr[-2000:]}")
    return elapsed, cpu, done.stdout


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="512,1024,2048,4096")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="64 ranks, one repetition")
    parser.add_argument("--json", type=Path, default=None, help="save every timing here")
    args = parser.parse_args()
    sizes = [64] if args.smoke else [int(size) for size in args.sizes.split(",")]
    repetitions = 1 if args.smoke else args.repetitions
    with tempfile.TemporaryDirectory(prefix="bench_postmortem_") as tmp:
        runs, victims, write_s = {}, {}, {}
        for size in sizes:
            ranks, victims[size] = scenario(size)
            runs[size] = Path(tmp, f"world-{size}", "memory_records")
            started = time.perf_counter()
            write_run(runs[size], ranks, run_id=f"bench-{size}")
            write_s[size] = time.perf_counter() - started
            files = list(runs[size].iterdir())
            print(
                f"wrote {len(files)} record files for {size} ranks "
                f"({sum(f.stat().st_size for f in files) / 1e6:.0f} MB) in {write_s[size]:.1f} s",
                flush=True,
            )
        variants = [v for v in VARIANTS if not (args.smoke and v == "text + PNG")]  # the PNG is tested apart
        timings = {(size, variant): [] for size in sizes for variant in variants}
        cpu = {cell: [] for cell in timings}
        cells = list(timings)
        for repetition in range(repetitions):
            shift = repetition * 5 % len(cells)
            for size, variant in cells[shift:] + cells[:shift]:
                elapsed, cpu_s, out = time_command(runs[size], VARIANTS[variant], Path(tmp, f"pm-{size}.png"))
                if variant == "--json":
                    first = json.loads(out)["first_failure"]
                    assert first["rank"] == victims[size] and first["status"] == "unfinished", first
                    assert first["probable_host_oom_kill"], first
                timings[size, variant].append(elapsed)
                cpu[size, variant].append(cpu_s)
                print(
                    f"  rep {repetition}: {size} ranks, {variant}: {elapsed:.2f} s wall, {cpu_s:.2f} s CPU", flush=True
                )
    print("\nwall time:")
    _table(sizes, variants, timings, write_s)
    print("\nCPU time of the command (user + system):")
    _table(sizes, variants, cpu, write_s)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    f"{size}|{variant}": {"wall_s": timings[size, variant], "cpu_s": cpu[size, variant]}
                    for size, variant in timings
                }
            )
        )
    worst = max(max(values) for values in timings.values())
    print(f"\nslowest run: {worst:.2f} s (target: under {TARGET_S:.0f} s at 4,096 ranks)")
    return 0


def _table(sizes, variants, timings, write_s) -> None:
    print(
        "| ranks | files written (s) | "
        + " | ".join(f"{v}: median (max), s" for v in variants)
        + " | "
        + " | ".join(f"{v} / {sizes[0]} ranks" for v in variants)
        + " |"
    )
    print("|" + "---:|" * (2 + 2 * len(variants)))
    for size in sizes:
        medians = [statistics.median(timings[size, v]) for v in variants]
        base = [statistics.median(timings[sizes[0], v]) for v in variants]
        cells = [f"{m:.2f} ({max(timings[size, v]):.2f})" for m, v in zip(medians, variants)]
        ratios = [f"{m / b:.2f}" for m, b in zip(medians, base)]
        print(f"| {size} | {write_s[size]:.1f} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    sys.exit(main())
