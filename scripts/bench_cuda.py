"""The CUDA side of ``make bench``: reading the allocator statistics, and with a GPU, a logging
step against Megatron-Bridge's, the floor, and a logging step behind queued GPU work.

    python scripts/bench_cuda.py                 # statistics; the GPU part too where CUDA is present
    python scripts/bench_cuda.py --reps 3000 --json out.json

What each number is: scripts/bench/cuda.py (also part 5 of scripts/bench_overhead.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.cuda import gpu_markdown, run_gpu_part, statistics_markdown, statistics_part  # noqa: E402
from nemo_memlog.testing.tmp import private_tmpdir  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3000, help="interleaved calls per statistics variant")
    parser.add_argument("--queued-ms", type=float, default=300, help="GPU work queued before each queued-case step")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU part even where CUDA is present")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    result = {"statistics": statistics_part(args.reps)}
    lines = statistics_markdown(result["statistics"])
    if torch.cuda.is_available() and not args.no_gpu:
        result["gpu"] = run_gpu_part(args.reps, args.queued_ms)
        lines += [""] + gpu_markdown(result["gpu"])
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    with private_tmpdir(prefix="nemo_memlog_bench_tmp_"):
        sys.exit(main())
