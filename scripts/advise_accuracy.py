"""How close ``nemo-memlog advise`` comes to a rerun, on the demo or on megatron-core's GPT where
activations dominate (``--job megatron``): the tables in docs/advise.md.

Runs the demo (megatron-core's GPTModel, DDP, Adam, 1F1B, PP 4 on 4 CPU processes, through
scripts/demo.py as a user runs it) once as the base, once again unchanged (what a rerun of the same
configuration moves by), and once per change (micro-batch size x2 and x0.5, microbatches x2). Then,
per change and per stage, the base's prediction (``advise --what-if ... --json``: ``peak_gb``,
``peak_low_gb``, ``peak_high_gb``) from one run, and from two (``--calibrate-with`` the run of
another size), against the peak the rerun recorded (its records' ``peak_host_rss_gb``, read apart
from advice/), and the predicted change of each stage's peak against the rerun's change (the
change is what a user asks: the fixed part of a process hides its error in the peak's). Prints the
table as markdown. About 10 minutes on 2 idle cores; a line per step, and each demo's own progress
bar (stderr) while it runs.

``--job megatron``: the same five runs of ``nemo_memlog.testing.megatron.job`` (megatron-core's
GPTModel in its DDP, Adam, 1F1B, PP 2 under torchrun) at hidden 64, seq 256, micro-batch size 64, 4
microbatches (256 samples per iteration), 5 iterations: the activation-heavy regime (about 8 minutes).

    .venv/bin/python scripts/advise_accuracy.py [--job demo|megatron] [--work-dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The demo as `make demo` runs it (micro-batch size 128, 4 microbatches: 512 samples per iteration,
#: kept by a micro-batch change, as Megatron's global batch is), shorter (4 iterations, no checkpoint:
#: the training peak is what advise predicts), TensorBoard only (the other backends live in the
#: writer process).
BASE = ["train.iters=4", "train.save_every=0", "train.global_batch_size=512"]
BASE += ["logger.wandb_project=null", "logger.mlflow_experiment=null", "logger.comet_project=null"]
#: label: (the demo's override for the rerun, advise's change, the run that calibrates it)
CHANGES = {
    "micro_batch_size=x2": ("train.micro_batch_size=256", "micro_batch_size=x2", "x0.5"),
    "micro_batch_size=x0.5": ("train.micro_batch_size=64", "micro_batch_size=x0.5", "x2"),
    "microbatches=8": ("train.global_batch_size=1024", "microbatches=8", "x2"),
}
#: The rerun of each change, by the name of its run.
RERUN_OF = {"micro_batch_size=x2": "x2", "micro_batch_size=x0.5": "x0.5", "microbatches=8": "mb8"}
#: name -> the demo's overrides beyond BASE: the base, the base again, and each change's rerun.
RUNS = {"base": [], "same": [], **{name: [CHANGES[label][0]] for label, name in RERUN_OF.items()}}


#: The megatron job (``--job megatron``): label -> (its overrides of MEGATRON's options).
MEGATRON = ["--hidden", "64", "--seq", "256", "--iters", "5"]
MEGATRON_RUNS = {
    "base": ["--micro-batch-size", "64", "--global-batch", "256"],
    "same": ["--micro-batch-size", "64", "--global-batch", "256"],
    "x2": ["--micro-batch-size", "128", "--global-batch", "256"],
    "x0.5": ["--micro-batch-size", "32", "--global-batch", "256"],
    "mb8": ["--micro-batch-size", "64", "--global-batch", "512"],
}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_demo(root: Path, name: str, overrides: list[str]) -> Path:
    started = time.monotonic()
    say(f"demo '{name}' ({' '.join(overrides) or 'the base'}) ...")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "scripts/demo.py", *BASE, *overrides, f"run.root={root}", f"run.name={name}"]
    # Its stderr (the progress bar: iteration k of n, its set-up) to the terminal as it runs; its
    # stdout (its closing table and commands) away from the markdown this script prints.
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"demo '{name}' failed ({done.returncode}): its output is above")
    say(f"demo '{name}' done in {time.monotonic() - started:.0f} s")
    return root / name


def run_megatron(root: Path, name: str, options: list[str]) -> Path:
    started = time.monotonic()
    say(f"megatron job '{name}' ({' '.join(options)}) ...")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "nemo_memlog.testing.megatron.job", *MEGATRON, *options, "--out", str(root / name)]
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"megatron job '{name}' failed ({done.returncode}): {done.stderr[-3000:]}")
    say(f"megatron job '{name}' done in {time.monotonic() - started:.0f} s")
    return root / name


def advised(run: Path, change: str, calibrate: Path | None = None) -> dict[int, dict]:
    command = [sys.executable, "-m", "nemo_memlog.cli", "advise", str(run), "--what-if", change]
    command += ["--json", "--no-png"] + (["--calibrate-with", str(calibrate)] if calibrate else [])
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    return {row["stage"]: row for row in json.loads(done.stdout)["stages"]}


def pct(predicted: float, truth: float) -> str:
    return f"{(predicted / truth - 1) * 100:+.1f}%"


def table(runs: dict[str, Path]) -> str:
    from nemo_memlog.testing.megatron.cpu import recorded_stage_peaks

    measured = {name: recorded_stage_peaks(path / "memory_records") for name, path in runs.items()}
    lines = ["| change | stage | rerun | one run: peak | one run: range | range holds | two runs "]
    lines[0] += "| change: rerun | change: one run | change: error |"
    lines.append("|---|---:|---:|---:|---:|:---:|---:|---:|---:|---:|")
    for label, (_, change, calibrator) in CHANGES.items():
        say(f"advise {change} (one run, and calibrated with '{calibrator}') ...")
        one = advised(runs["base"], change)
        two = advised(runs["base"], change, runs[calibrator])
        for stage, truth in sorted(measured[RERUN_OF[label]].items()):
            row = one[stage]
            low, high = row.get("peak_low_gb") or row["peak_gb"], row.get("peak_high_gb") or row["peak_gb"]
            if row.get("peak_low_gb") == row.get("peak_high_gb"):  # a single figure: no range given
                span, holds = "none", "-"
            else:
                span = f"{pct(low, truth)} .. {pct(high, truth)}"
                holds = "yes" if low <= truth * 1.005 and high >= truth * 0.995 else "no"
            cells = [f"`{change}`" if stage == 0 else "", str(stage), f"{truth:.3f} GB"]
            cells += [pct(row["peak_gb"], truth), span, holds]
            cells += [pct(two[stage]["peak_gb"], truth)]
            before = measured["base"][stage]
            change, predicted = truth - before, row["peak_gb"] - before
            cells += [
                f"{change * 1000:+.1f} MB",
                f"{predicted * 1000:+.1f} MB",
                pct(predicted, change) if change else "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    noise = [pct(measured["same"][s], measured["base"][s]) for s in sorted(measured["base"])]
    lines.append("")
    lines.append(f"The same configuration run again, per stage: {', '.join(noise)}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", help="where the runs go (default: a temporary folder, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--job", choices=("demo", "megatron"), default="demo", help="the job run (module docstring)")
    args = parser.parse_args()
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="advise-accuracy-"))
    try:
        if args.job == "megatron":
            runs = {name: run_megatron(root, name, options) for name, options in MEGATRON_RUNS.items()}
        else:
            runs = {name: run_demo(root, name, overrides) for name, overrides in RUNS.items()}
        print(table(runs))
    finally:
        if not args.work_dir and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        elif args.keep:
            say(f"runs kept in {root}")


if __name__ == "__main__":
    main()
