"""Part 11: what nemo_memlog costs in Megatron-LM's own loop (``megatron.training.pretrain``), PP 2 on CPU.

Two torchrun launches of nemo_memlog.testing.megatron.lm_job, the same model and flags, with
``--log-memory-to-tensorboard --tensorboard-log-interval 2``: Megatron-LM alone, and with
``--nemo-memlog`` (``megatron_lm.install()``). Each times every iteration from ``train_step``'s start
to the end of its ``training_log`` (``--iteration-times``). Within each launch the logging (even) and
off-interval (odd) iterations alternate, so their ratio is taken in one run, interleaved: ours
minus alone's is what a logging step of ours costs, as a share of an iteration. The off-interval
iterations of the two runs show what the wrappers cost when they only call through. One launch at
a time; the first 4 iterations (warm-up) are left out.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from nemo_memlog.testing import torchrun

#: The shape: the meter's Megatron part's model (part 10), on two pipeline stages.
FLAGS = (
    *("--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "256"),
    *("--num-attention-heads", "8", "--seq-length", "256", "--max-position-embeddings", "256"),
    *("--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-4", "--eval-interval", "100000"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1023", "--log-interval", "1000"),
    *("--distributed-backend", "gloo", "--transformer-impl", "local", "--no-persist-layer-norm"),
    *("--no-gradient-accumulation-fusion", "--log-memory-to-tensorboard", "--tensorboard-log-interval", "2"),
)
WARMUP = 4


def megatron_lm_part(iterations: int) -> dict:
    """{"alone"|"ours": {"logging_ms", "off_ms", "ratio"}, "overhead": ours ratio / alone ratio - 1}."""
    result: dict = {"iterations": iterations}
    with tempfile.TemporaryDirectory(prefix="nemo_memlog_bench_lm_") as root:
        for name, extra in (("alone", ()), ("ours", ("--nemo-memlog",))):
            print(f"# part 11: Megatron-LM's loop, {name}, {iterations} iterations ...", file=sys.stderr, flush=True)
            folder = Path(root) / name
            done = torchrun.run(
                "-m",
                "nemo_memlog.testing.megatron.lm_job",
                *FLAGS,
                "--train-iters",
                iterations,
                "--tensorboard-dir",
                folder / "tb",
                "--iteration-times",
                folder / "times",
                *extra,
                timeout_s=900,
            )
            if done.returncode != 0:
                raise RuntimeError(f"Megatron-LM's loop ({name}) exited with {done.returncode}:\n{torchrun.tail(done)}")
            result[name] = _split(json.loads((folder / "times" / "times-0.json").read_text()))  # stage 0: the peak
    result["overhead"] = result["ours"]["ratio"] / result["alone"]["ratio"] - 1
    result["off_overhead"] = result["ours"]["off_ms"] / result["alone"]["off_ms"] - 1
    return result


def _split(times: dict) -> dict:
    logging = [t for i, t in times.items() if int(i) > WARMUP and int(i) % 2 == 0]
    off = [t for i, t in times.items() if int(i) > WARMUP and int(i) % 2]
    pairs = [times[str(i)] / times[str(i - 1)] for i in range(WARMUP + 2, len(times) + 1, 2) if str(i - 1) in times]
    return {
        "logging_ms": 1e3 * statistics.median(logging),
        "off_ms": 1e3 * statistics.median(off),
        "ratio": statistics.median(pairs),
        "n": len(pairs),
    }


def megatron_lm_markdown(part: dict | None) -> list[str]:
    if not part:
        return []
    rows = [
        f"| {name} | {part[name]['logging_ms']:.1f} | {part[name]['off_ms']:.1f} | x{part[name]['ratio']:.3f} "
        f"| {part[name]['n']} |"
        for name in ("alone", "ours")
    ]
    return [
        "",
        "Megatron-LM's own loop (pretrain, PP 2, gloo, GPTModel 4 layers, hidden 256, seq 256, 4 microbatches of 4), "
        "stage 0, ms per iteration from train_step to the end of training_log, median:",
        "",
        "| run | logging iteration | off-interval iteration | logging / the off-interval one before it (median) | n |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        f"A logging step of ours costs {100 * part['overhead']:+.1f}% of an iteration (the ratios' quotient); "
        f"off-interval iterations {100 * part['off_overhead']:+.1f}% (two runs, not interleaved: noise).",
    ]
