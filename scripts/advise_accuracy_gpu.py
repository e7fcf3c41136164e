"""How close ``nemo-memlog advise --what-if micro_batch_size=x2`` comes to a rerun on a GPU, for the
allocator's own peaks (``peak_allocated_gb``, ``peak_reserved_gb``): the GPU table in docs/advise.md.

Trains Megatron-LM's own loop (``nemo_memlog.testing.megatron.lm_job``: ``pretrain`` on megatron-core's
GPTModel, a world of one under torchrun, with ``--nemo-memlog``, which writes each rank's per-layer
record into ``memory_records`` beside ``--tensorboard-dir``) twice: at micro-batch size 2 and at 4, the
global batch fixed (8: 4 microbatches, then 2). Then ``nemo-memlog advise RUN_OF_2 --what-if
micro_batch_size=x2 --json --no-png``, and per figure its predicted peak (the predicted parts: the model
state, activations and temporaries for the allocated peak, the allocator slack on top for the reserved
one), its range (``peak_low_gb`` .. ``peak_high_gb``, which differ from ``peak_gb`` by the temporaries
alone), against the peak the rerun at 4 recorded, read straight from its record's JSON (not through
nemo_memlog.advice). Prints a markdown table: the measured and the predicted change, the error of the
change, and whether the rerun's peak lies in the range.

    python3 scripts/advise_accuracy_gpu.py                  # on the GPU (NCCL), about a minute on an H200
    .venv/bin/python scripts/advise_accuracy_gpu.py --device cpu --hidden 64 --seq 64   # the same on CPU (gloo)

``--device cpu`` runs the job on gloo with Megatron-LM's CPU stand-ins (the job installs them where no CUDA
is present): the records then hold no allocator figures, and the table compares the process's peak
(``peak_host_rss_gb``) instead, as scripts/advise_accuracy.py does. ``--json FILE`` also writes every figure.
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
#: The advised parts of a stage's peak that the caching allocator holds as allocated (advice/model.py's
#: PARTS, bottom to top); the reserved peak adds the allocator's slack; ``outside_gb`` is neither.
ALLOCATED_PARTS = ("params_gb", "grads_gb", "optimizer_state_gb", "activations_gb", "temporaries_gb")
RESERVED_PARTS = (*ALLOCATED_PARTS, "allocator_slack_gb")
CHANGE = "micro_batch_size=x2"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def job_flags(args: argparse.Namespace, micro_batch_size: int) -> list[str]:
    """Megatron-LM's flags for one run (tests/gpu/test_megatron_lm_gpu.py's FLAGS, sized by ``args``)."""
    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "8"]
    flags += ["--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq)]
    flags += ["--micro-batch-size", str(micro_batch_size), "--global-batch-size", str(args.global_batch)]
    flags += ["--train-iters", str(args.iters), "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer"]
    flags += ["--vocab-size", "4095", "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1"]
    flags += ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion"]
    flags += ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion"]
    flags += ["--log-memory-to-tensorboard", "--nemo-memlog"]
    if args.device == "cpu":
        flags += ["--distributed-backend", "gloo"]
    return flags


def run_job(args: argparse.Namespace, root: Path, micro_batch_size: int) -> Path:
    """One training run at ``micro_batch_size``; its folder (``tb`` and ``memory_records`` in it)."""
    folder = root / f"mbs{micro_batch_size}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    command += ["-m", "nemo_memlog.testing.megatron.lm_job", *job_flags(args, micro_batch_size)]
    command += ["--tensorboard-dir", str(folder / "tb")]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.dry_run:
        print(" ".join(command))
        return folder
    started = time.monotonic()
    say(f"micro-batch size {micro_batch_size}: {args.iters} iterations of global batch {args.global_batch} ...")
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "output.txt").write_text(done.stdout)
    if done.returncode != 0:
        raise SystemExit(
            f"the run at micro-batch size {micro_batch_size} failed ({done.returncode}):\n{done.stdout[-4000:]}"
        )
    say(f"micro-batch size {micro_batch_size} done in {time.monotonic() - started:.0f} s")
    return folder


def recorded(folder: Path) -> dict:
    """The one rank's per-layer record (``memory_records/rank-00000.layers.json``), read as plain JSON."""
    files = sorted((folder / "memory_records").glob("rank-*.layers.json"))
    if len(files) != 1:
        raise SystemExit(f"expected one per-layer record in {folder / 'memory_records'}, found {len(files)}")
    return json.loads(files[0].read_text())


def advised(folder: Path) -> dict:
    """advise's JSON for the run in ``folder`` under micro_batch_size=x2: its stage 0."""
    command = [sys.executable, "-m", "nemo_memlog.cli", "advise", str(folder), "--what-if", CHANGE]
    done = subprocess.run([*command, "--json", "--no-png"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"advise failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    stages = json.loads(done.stdout)["stages"]
    return stages[0]


def rows(base: dict, rerun: dict, outcome: dict, gpu: bool) -> list[dict]:
    """Per figure: the base's and the rerun's recorded peak, advise's prediction and its range (GB)."""
    spread_low = outcome["peak_low_gb"] - outcome["peak_gb"]  # the range moves the temporaries alone
    spread_high = outcome["peak_high_gb"] - outcome["peak_gb"]
    predicted, now = outcome["predicted"], outcome["now"]
    figures = {"peak_allocated_gb": ALLOCATED_PARTS, "peak_reserved_gb": RESERVED_PARTS} if gpu else {}
    out = []
    for name, parts in figures.items():
        point = sum(predicted.get(part) or 0.0 for part in parts)
        out.append(
            {
                "figure": name,
                "base_gb": base["stage"][name],
                "base_from_parts_gb": sum(now.get(part) or 0.0 for part in parts),
                "rerun_gb": rerun["stage"][name],
                "predicted_gb": point,
                "low_gb": point + spread_low,
                "high_gb": point + spread_high,
            }
        )
    out.append(
        {
            "figure": "advise peak_gb" if gpu else "peak_host_rss_gb",
            "base_gb": outcome["peak_now_gb"] if gpu else base["stage"]["peak_host_rss_gb"],
            "base_from_parts_gb": outcome["peak_now_gb"],
            "rerun_gb": (rerun["stage"]["peak_reserved_gb"] + rerun["stage"].get("device_other_gb", 0.0))
            if gpu
            else rerun["stage"]["peak_host_rss_gb"],
            "predicted_gb": outcome["peak_gb"],
            "low_gb": outcome["peak_low_gb"],
            "high_gb": outcome["peak_high_gb"],
        }
    )
    return out


def pct(value: float, truth: float) -> str:
    return f"{(value / truth - 1) * 100:+.1f}%" if truth else "-"


def markdown(table: list[dict]) -> str:
    lines = [
        "| figure | mbs 2 (recorded) | mbs 4 (rerun) | change: rerun | change: predicted | change: error "
        "| predicted peak | range | rerun in range |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in table:
        change, predicted = row["rerun_gb"] - row["base_gb"], row["predicted_gb"] - row["base_gb"]
        holds = row["low_gb"] <= row["rerun_gb"] * 1.005 and row["high_gb"] >= row["rerun_gb"] * 0.995
        cells = [f"`{row['figure']}`", f"{row['base_gb']:.4f} GB", f"{row['rerun_gb']:.4f} GB"]
        cells += [f"{change * 1000:+.1f} MB", f"{predicted * 1000:+.1f} MB", pct(predicted, change)]
        cells += [f"{row['predicted_gb']:.4f} GB ({pct(row['predicted_gb'], row['rerun_gb'])})"]
        cells += [f"{row['low_gb']:.4f} .. {row['high_gb']:.4f} GB", "yes" if holds else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: NCCL; cpu: gloo")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=8, help="fixed: the microbatches follow the size")
    parser.add_argument("--iters", type=int, default=6, help="iterations per run (each one a logging step)")
    parser.add_argument("--work-dir", help="where the runs go (default: a temporary folder, removed)")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--dry-run", action="store_true", help="print the two launch commands, run nothing")
    args = parser.parse_args(argv)
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="advise-accuracy-gpu-"))
    try:
        folders = {size: run_job(args, root, size) for size in (2, 4)}
        if args.dry_run:
            return 0
        base, rerun = recorded(folders[2]), recorded(folders[4])
        gpu = "peak_allocated_gb" in base["stage"]
        if args.device == "cuda" and not gpu:
            raise SystemExit("the records hold no allocator figures (peak_allocated_gb): not a CUDA run")
        outcome = advised(folders[2])
        table = rows(base, rerun, outcome, gpu)
        print(f"micro_batch_size=x2 (2 -> 4, global batch {args.global_batch}, {args.iters} iterations, ")
        print(f"hidden {args.hidden}, seq {args.seq}, {args.layers} layers), recorded at iterations ")
        print(f"{base['iteration']} and {rerun['iteration']}; advise's parts today add up to: ")
        print(", ".join(f"{row['figure']} {row['base_from_parts_gb']:.4f} GB" for row in table) + "\n")
        print(markdown(table))
        if args.json:
            Path(args.json).write_text(
                json.dumps({"rows": table, "advise": outcome, "base": base["stage"], "rerun": rerun["stage"]}, indent=1)
            )
    finally:
        if not args.work_dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
