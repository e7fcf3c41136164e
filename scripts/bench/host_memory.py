"""Part 4 of the overhead benchmark: the writer rank's host memory.

tests/trainer.py (of a source checkout) three times, logging off and in each writer_mode, with
the same backends: the writer rank's host RSS after 20 logged steps, and the writer process's own.
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.stand_ins import REPOSITORY
from bench.writer import MODES

TRAINER = REPOSITORY / "tests" / "trainer.py"


def host_memory_part(backends: tuple, root: str) -> dict:
    """The writer rank's host RSS after 20 logged steps (tests/trainer.py), per mode and off, MB."""
    memory = {}
    for mode in ("off",) + MODES:
        done = subprocess.run(
            [sys.executable, str(TRAINER), f"{root}/rss_{mode}", "--mode", mode, "--backends", ",".join(backends)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode:
            raise RuntimeError(f"tests/trainer.py --mode {mode} failed:\n{done.stderr[-2000:]}")
        memory[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    return memory


def memory_markdown(memory: dict | None) -> list[str]:
    """Part 4's table, MB."""
    if not memory:
        return []
    off = memory["off"]
    lines = [
        "",
        "Writer rank's host memory after 20 logged steps (tests/trainer.py), MB:",
        "",
        "| | RSS | peak RSS (VmHWM) | RSS - off | the writer process's own RSS |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {mode} | {m['rss_mb']:.1f} | {m['peak_rss_mb']:.1f} | {m['rss_mb'] - off['rss_mb']:+.1f} "
        f"| {'-' if m['writer_rss_mb'] is None else format(m['writer_rss_mb'], '.1f')} |"
        for mode, m in memory.items()
    ]
    return lines
